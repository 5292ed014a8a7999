// The fault cases of issue 20 (a replica that swaps, skips or adds a collective), written once
// for every verifying backend: each must be an error on every replica naming the sequence
// number and both calls (their tags, or their call sites in this file), before any wrong value
// is returned. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/collective_tag.hpp"
#include "lockstep/comm/communicator.hpp"
#include "lockstep/core/error.hpp"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <span>
#include <string>
#include <vector>

namespace lockstep::testing {

enum class call_fault {
    swapped_kinds,  ///< replica 1 calls broadcast, all_reduce; the others all_reduce, broadcast
    swapped_tagged, ///< two same-shape tagged all_reduces, swapped on replica 1
    skipped,        ///< replica 1 skips the broadcast between two all_reduces
    skipped_tagged, ///< replica 1 skips the first of two same-shape tagged all_reduces
    extra,          ///< replica 1 calls an all_gather the others do not, then the all_reduce
    // Untagged, so only call sites tell the calls apart (check_call_sites on):
    swapped_sites, ///< two same-shape untagged all_reduces, swapped on replica 1
    skipped_sites  ///< replica 1 skips the first of two same-shape untagged all_reduces
};

/// The faults every verifying backend catches by default, and those it catches only when it
/// checks call sites.
inline constexpr call_fault default_faults[] = {call_fault::swapped_kinds,
                                                call_fault::swapped_tagged, call_fault::skipped,
                                                call_fault::skipped_tagged, call_fault::extra};
inline constexpr call_fault site_faults[] = {call_fault::swapped_sites, call_fault::skipped_sites};

/// What one replica saw: the error it threw ("" when none) and whether every buffer holds what
/// the replica would hold had the calls before the mismatch run and nothing after.
struct fault_outcome {
    bool threw = false;
    int replica = -1;
    std::string what;
    bool buffers_ok = false;
};

/// What the error must name: the mismatched call's sequence number and both sides' calls
/// ("replica 1 called broadcast #3") and, for tagged calls, both tags; `sites`: both calls'
/// sites in this file, on different lines (see named_sites).
struct fault_expectation {
    std::string odd, normal;
    std::string odd_tag, normal_tag;
    bool sites = false;
};

/// The distinct lines of this file that `what` names as call sites ("at
/// call_identity_cases.hpp:123"), in order of appearance.
inline std::vector<int> named_sites(const std::string& what) {
    const std::string key = "at call_identity_cases.hpp:";
    std::vector<int> lines;
    for (auto at = what.find(key); at != std::string::npos; at = what.find(key, at + 1)) {
        const int line = std::atoi(what.c_str() + at + key.size());
        if (std::find(lines.begin(), lines.end(), line) == lines.end())
            lines.push_back(line);
    }
    return lines;
}

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
    case call_fault::swapped_sites:
    case call_fault::skipped_sites:
        return {call(1, "all_reduce", first), call(0, "all_reduce", first), "", "", true};
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
        case call_fault::swapped_sites:
            if (odd) {
                reduce(b);
                reduce(a);
            } else {
                reduce(a);
                reduce(b);
            }
            break;
        case call_fault::skipped_sites:
            if (!odd)
                reduce(a);
            reduce(b);
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
