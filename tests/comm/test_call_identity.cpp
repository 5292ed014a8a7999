// thread_communicator against a replica that swaps, skips or adds a collective: an error on
// every replica naming the sequence number and both calls, and no wrong value.
// SPDX-License-Identifier: Apache-2.0
#include "call_identity_cases.hpp"
#include "lockstep/comm/thread_group.hpp"
#include "support/contains.hpp"

#include <catch2/catch.hpp>

#include <span>
#include <string>
#include <vector>

using lockstep::reduce_op;
using lockstep::thread_communicator;
using lockstep::thread_group;
using lockstep::testing::call_fault;

using lockstep_test::contains;

namespace {

// Runs fault f on n replicas of a group that checks call sites or not, and checks that every
// replica threw the error that names both calls, with every buffer untouched by the bad call.
void check_fault(call_fault f, int n, bool sites) {
    CAPTURE(static_cast<int>(f), n, sites);
    thread_group group(n, {.check_call_sites = sites});
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
        if (want.sites)
            CHECK(lockstep::testing::named_sites(o.what).size() == 2);
        CHECK(o.buffers_ok);
    }
}

} // namespace

TEST_CASE("a swapped, skipped or extra collective fails on every replica, naming both calls",
          "[comm][thread]") {
    const int n = GENERATE(2, 3);
    const bool sites = GENERATE(false, true);
    for (const auto f : lockstep::testing::default_faults)
        check_fault(f, n, sites);
}

TEST_CASE("with call sites checked, same-shape untagged calls swapped or skipped fail, naming "
          "both sites",
          "[comm][thread]") {
    const int n = GENERATE(2, 3);
    for (const auto f : lockstep::testing::site_faults)
        check_fault(f, n, true);
}

TEST_CASE("untagged calls of one shape in another order pair silently when call sites are not "
          "checked (the documented limit)",
          "[comm][thread]") {
    // Without tags or call sites nothing tells two same-shape all_reduces apart; the swap on
    // replica 1 pairs a with b. This pins down what collective_tag says is not caught.
    thread_group group(3, {.check_call_sites = false});
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

TEST_CASE("with call sites checked, a name pairs calls made from different lines",
          "[comm][thread]") {
    // A root-dependent branch calls broadcast from two lines: legal, and named so that the
    // call-site check does not refuse it; unnamed, the same code is refused on every replica.
    for (const bool named : {true, false}) {
        CAPTURE(named);
        thread_group group(3, {.check_call_sites = true});
        std::vector<float> got(3, 0.0f);
        std::vector<std::string> errors(3);
        group.run([&](thread_communicator& comm) {
            const auto r = static_cast<std::size_t>(comm.rank());
            const lockstep::collective_tag tag = named ? "weights" : "";
            std::vector<float> v{float(10 * (r + 1))};
            try {
                if (r == 0)
                    comm.broadcast(std::span<float>(v), 0,
                                   named ? tag : lockstep::collective_tag{});
                else
                    comm.broadcast(std::span<float>(v), 0,
                                   named ? tag : lockstep::collective_tag{});
            } catch (const lockstep::error& e) {
                errors[r] = e.what();
            }
            got[r] = v[0];
        });
        for (std::size_t r = 0; r < 3; ++r) {
            CAPTURE(r, errors[r]);
            if (named) {
                CHECK(errors[r].empty());
                CHECK(got[r] == 10.0f);
            } else {
                CHECK(contains(errors[r], "at test_call_identity.cpp:"));
                CHECK(got[r] == float(10 * (r + 1)));
            }
        }
    }
}
