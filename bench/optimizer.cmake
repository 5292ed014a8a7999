# bench_optimizer: fused optimizer step time vs its memory-traffic bound (STREAM copy).
add_executable(bench_optimizer "${CMAKE_CURRENT_SOURCE_DIR}/optimizer.cpp")
target_link_libraries(bench_optimizer PRIVATE ${LOCKSTEP_HOST_TARGET})
# GCC vectorizes sqrt (Adam, LAMB) only without errno semantics.
target_compile_options(bench_optimizer PRIVATE $<$<CXX_COMPILER_ID:GNU,Clang>:-fno-math-errno>)
