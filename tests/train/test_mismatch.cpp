// tests/train/test_mismatch.cpp: the mistakes of mismatch_cases.hpp on the thread group: every
// replica throws, with the code test_mismatch_mpi.cpp expects over MPI, naming the cause.
// SPDX-License-Identifier: Apache-2.0
#include "mismatch_cases.hpp"

#include <catch2/catch.hpp>

#include <mutex>

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
