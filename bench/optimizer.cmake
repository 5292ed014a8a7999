# bench_optimizer: fused optimizer step time vs its memory-traffic bound (STREAM copy).
lockstep_add_bench(bench_optimizer "${CMAKE_CURRENT_LIST_DIR}/optimizer.cpp")
# GCC vectorizes sqrt (Adam, LAMB) only without errno semantics.
target_compile_options(bench_optimizer PRIVATE $<$<CXX_COMPILER_ID:GNU,Clang>:-fno-math-errno>)
