// The fault cases of issue 20 (a replica that swaps, skips or adds a collective), written once
// for every verifying backend: each must be an error on every replica naming the sequence
// number and both calls, before any wrong value is returned. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/collective_tag.hpp"
#include "lockstep/comm/communicator.hpp"
#include "lockstep/core/error.hpp"

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace lockstep::testing {

enum class call_fault {
    swapped_kinds,  ///< replica 1 calls broadcast, all_reduce; the others all_reduce, broadcast
    swapped_tagged, ///< two same-shape tagged all_reduces, swapped on replica 1
    skipped,        ///< replica 1 skips the broadcast between two all_reduces
    skipped_tagged, ///< replica 1 skips the first of two same-shape tagged all_reduces
    extra           ///< replica 1 calls an all_gather the others do not, then the all_reduce
};

/// What one replica saw: the error it threw ("" when none) and whether every buffer holds what
/// the replica would hold had the calls before the mismatch run and nothing after.
struct fault_outcome {
    bool threw = false;
    int replica = -1;
    std::string what;
    bool buffers_ok = false;
};

/// What the error must name: the mismatched call's sequence number and both sides' calls
/// ("replica 1 called broadcast #3") and, for tagged calls, both tags.
struct fault_expectation {
    std::string odd, normal;
    std::string odd_tag, normal_tag;
};

/// The expected texts, given the number of the case's first call (thread_communicator counts
/// from 0 in a fresh group; mpi_communicator's first collective is #1).
inline fault_expectation expected_fault(call_fault f, std::uint64_t first) {
    const auto call = [](int replica, const char* what, std::uint64_t s) {
        return "replica " + std::to_string(replica) + " called " + what + " #" + std::to_string(s);
    };
    switch (f) {
    case call_fault::swapped_kinds:
        return {call(1, "broadcast", first), call(0, "all_reduce", first), "", ""};
    case call_fault::swapped_tagged:
    case call_fault::skipped_tagged:
        return {call(1, "all_reduce", first), call(0, "all_reduce", first), "tag 'b'", "tag 'a'"};
    case call_fault::skipped:
        return {call(1, "all_reduce", first + 1), call(0, "broadcast", first + 1), "", ""};
    case call_fault::extra:
        return {call(1, "all_gather", first), call(0, "all_reduce", first), "", ""};
    }
    return {};
}

/// Runs the case on this replica (replica 1 is the faulty one; needs size() >= 2) and reports
/// what it saw. Inputs differ per replica: a = rank + 1, b = 100 * (rank + 1), so a wrong
/// pairing would change the values (the issue's 104 where 6 is right).
template <class Comm>
fault_outcome run_call_fault(Comm& comm, call_fault f) {
    const int r = comm.rank(), n = comm.size();
    const bool odd = r == 1;
    const std::vector<float> a0(4, float(r + 1)), b0(4, float(100 * (r + 1)));
    std::vector<float> a = a0, b = b0, gathered(4 * static_cast<std::size_t>(n));
    float sum_a = 0;
    for (int j = 0; j < n; ++j)
        sum_a += float(j + 1);
    const auto reduce = [&](std::vector<float>& v, collective_tag tag = {}) {
        comm.all_reduce(std::span<const float>(v), std::span<float>(v), reduce_op::sum, tag);
    };
    const auto bcast = [&](std::vector<float>& v) { comm.broadcast(std::span<float>(v), 0); };
    // The buffers each replica must hold after the failure: the calls before the mismatch
    // completed, nothing of the mismatched call or later was written.
    std::vector<float> want_a = a0, want_b = b0;
    fault_outcome out;
    try {
        switch (f) {
        case call_fault::swapped_kinds:
            if (odd) {
                bcast(b);
                reduce(a);
            } else {
                reduce(a);
                bcast(b);
            }
            break;
        case call_fault::swapped_tagged:
            if (odd) {
                reduce(b, {"b"});
                reduce(a, {"a"});
            } else {
                reduce(a, {"a"});
                reduce(b, {"b"});
            }
            break;
        case call_fault::skipped:
            want_a.assign(4, sum_a);
            reduce(a);
            if (!odd)
                bcast(b);
            reduce(b);
            break;
        case call_fault::skipped_tagged:
            if (!odd)
                reduce(a, {"a"});
            reduce(b, {"b"});
            break;
        case call_fault::extra:
            if (odd)
                comm.all_gather(std::span<const float>(b), std::span<float>(gathered));
            reduce(a);
            break;
        }
    } catch (const lockstep::error& e) {
        out.threw = true;
        out.replica = e.replica();
        out.what = e.what();
    }
    out.buffers_ok = a == want_a && b == want_b;
    return out;
}

} // namespace lockstep::testing
