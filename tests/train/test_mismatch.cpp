// tests/train/test_mismatch.cpp: the mistakes of mismatch_cases.hpp on the thread group: every
// replica throws, with the code test_mismatch_mpi.cpp expects over MPI, naming the cause.
// SPDX-License-Identifier: Apache-2.0
#include "mismatch_cases.hpp"

#include "lockstep/train/detail/mark_order_hint.hpp"

#include <catch2/catch.hpp>

#include <mutex>
#include <string>

using namespace lockstep_test::mismatch;

TEST_CASE("thread group: a mistake that splits the replicas names its cause", "[train][thread]") {
    for (const mistake m : all_mistakes)
        for (const int replicas : {2, 3}) {
            CAPTURE(static_cast<int>(m), replicas);
            std::vector<outcome> out(static_cast<std::size_t>(replicas));
            try {
                lockstep::thread_group(replicas).run([&](lockstep::thread_communicator& comm) {
                    out[static_cast<std::size_t>(comm.rank())] = run(comm, m);
                });
            } catch (const lockstep::error&) {
            }
            for (const outcome& o : out) {
                INFO(o.message);
                CHECK(o.threw);
                CHECK(o.code == expected_code(m));
                for (const std::string& part : expected_parts(m, replicas))
                    CHECK(o.message.find(part) != std::string::npos);
            }
        }
}

// With overlap on an NCCL side stream, replicas marking gradients ready at different points
// deadlock into a timeout (tests/cuda/test_nccl_ranks_trainer.cu shows it on a GPU): the step's
// timeout or peer failure then names that cause and the fix, keeping its code, replica,
// operation and details; other errors, and steps without such overlap, are left alone.
TEST_CASE("a step's timeout with overlap on a side stream names the mark order", "[train]") {
    using lockstep::errc;
    using lockstep::error;
    const error timeout(errc::timeout, 1, "wait (data_parallel.step)",
                        "the event did not complete within 60000 ms");
    const error hinted = lockstep::detail::with_mark_order_hint(timeout, true);
    CHECK(hinted.code() == errc::timeout);
    CHECK(hinted.replica() == 1);
    CHECK(hinted.operation() == timeout.operation());
    const std::string what = hinted.what();
    CHECK(what.find("the event did not complete within 60000 ms; ") != std::string::npos);
    CHECK(what.find("mark_ready at the same program points") != std::string::npos);
    CHECK(what.find("overlap_mode::never") != std::string::npos);
    const error peer(errc::peer_failure, 0, "all_reduce #3", "a peer failed");
    CHECK(
        std::string(lockstep::detail::with_mark_order_hint(peer, true).what()).find("mark_ready") !=
        std::string::npos);
    CHECK(std::string(lockstep::detail::with_mark_order_hint(timeout, false).what()) ==
          timeout.what());
    const error shape(errc::shape_mismatch, 0, "all_reduce #3", "sizes differ");
    CHECK(std::string(lockstep::detail::with_mark_order_hint(shape, true).what()) == shape.what());
}
