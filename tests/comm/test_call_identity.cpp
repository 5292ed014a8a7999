// thread_communicator against a replica that swaps, skips or adds a collective: an error on
// every replica naming the sequence number and both calls, and no wrong value.
// SPDX-License-Identifier: Apache-2.0
#include "call_identity_cases.hpp"
#include "lockstep/comm/thread_group.hpp"

#include <catch2/catch.hpp>

#include <span>
#include <string>
#include <vector>

using lockstep::reduce_op;
using lockstep::thread_communicator;
using lockstep::thread_group;
using lockstep::testing::call_fault;

namespace {

bool contains(const std::string& s, const std::string& part) {
    return s.find(part) != std::string::npos;
}

} // namespace

TEST_CASE("a swapped, skipped or extra collective fails on every replica, naming both calls",
          "[comm][thread]") {
    const auto f = GENERATE(call_fault::swapped_kinds, call_fault::swapped_tagged,
                            call_fault::skipped, call_fault::skipped_tagged, call_fault::extra);
    const int n = GENERATE(2, 3);
    CAPTURE(static_cast<int>(f), n);
    thread_group group(n);
    std::vector<lockstep::testing::fault_outcome> seen(static_cast<std::size_t>(n));
    std::vector<int> after(static_cast<std::size_t>(n), 0);
    group.run([&](thread_communicator& comm) {
        const auto r = static_cast<std::size_t>(comm.rank());
        seen[r] = lockstep::testing::run_call_fault(comm, f);
        // The group stays usable: a collective after the error pairs again. Recorded here and
        // checked on the main thread (Catch2 assertions are not thread-safe).
        std::vector<int> one{1};
        comm.all_reduce(std::span<const int>(one), std::span<int>(one), reduce_op::sum);
        after[r] = one[0];
    });
    CHECK(after == std::vector<int>(static_cast<std::size_t>(n), n));
    const auto want = lockstep::testing::expected_fault(f, 0);
    for (int r = 0; r < n; ++r) {
        const auto& o = seen[static_cast<std::size_t>(r)];
        CAPTURE(r, o.what);
        CHECK(o.threw);
        CHECK(o.replica == r);
        CHECK(contains(o.what, "replica " + std::to_string(r) + ": "));
        CHECK(contains(o.what, want.odd));
        CHECK(contains(o.what, want.normal));
        CHECK(contains(o.what, want.odd_tag));
        CHECK(contains(o.what, want.normal_tag));
        CHECK(o.buffers_ok);
    }
}

TEST_CASE("untagged calls of one shape in another order pair silently (the documented limit)",
          "[comm][thread]") {
    // Tags are what tells two same-shape all_reduces apart; without them the swap on replica 1
    // pairs a with b. This pins down what docs/architecture.md says is not caught.
    thread_group group(3);
    std::vector<float> first(3);
    group.run([&](thread_communicator& comm) {
        const int r = comm.rank();
        std::vector<float> a{float(r + 1)}, b{float(100 * (r + 1))};
        auto& x = r == 1 ? b : a;
        auto& y = r == 1 ? a : b;
        comm.all_reduce(std::span<const float>(x), std::span<float>(x), reduce_op::sum);
        comm.all_reduce(std::span<const float>(y), std::span<float>(y), reduce_op::sum);
        first[static_cast<std::size_t>(r)] = a[0];
    });
    CHECK(first[0] == 1.0f + 200.0f + 3.0f); // the 104-style value, not 6
}
