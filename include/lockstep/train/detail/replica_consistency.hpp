// lockstep/train/detail/replica_consistency.hpp: the cross-replica consistency check
// (train_params::verify_every): a digest of every tensor replicas must hold identically,
// compared in one small all_gather, and on a mismatch the first differing element located.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/collective_tag.hpp"
#include "lockstep/comm/communicator.hpp"
#include "lockstep/comm/host_wait.hpp"
#include "lockstep/core/config.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/policy/bn.hpp"
#include "lockstep/system/buffer.hpp"
#include "lockstep/system/host_system.hpp"
#include "lockstep/system/staged_read.hpp"
#include "lockstep/train/detail/host_collective.hpp"
#include "lockstep/train/detail/replica_digest.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <span>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include <thrust/iterator/counting_iterator.h>
#include <thrust/transform.h>

namespace lockstep::detail {

/// True when every BN policy of the tuple keeps the running statistics identical on every
/// replica (bn::traits::shares_running_statistics); true for no policy at all.
template <class Tuple>
struct shares_running_statistics;
template <class... P>
struct shares_running_statistics<std::tuple<P...>>
    : std::bool_constant<(bn::traits<P>::shares_running_statistics && ...)> {};

/// The digest of elements [b * block, min(n, (b + 1) * block)): one per block, computed by one
/// thread each (only after a mismatch, to find the first differing block).
template <class T>
struct block_digest_fn {
    const T* data;
    std::size_t n, block;
    LOCKSTEP_HOST_DEVICE std::int64_t operator()(std::size_t b) const {
        std::uint64_t h = 0;
        const std::size_t end = (b + 1) * block < n ? (b + 1) * block : n;
        for (std::size_t i = b * block; i < end; ++i)
            h += digest_term_fn<T>{data}(i);
        return static_cast<std::int64_t>(h);
    }
};

/// The tag of the check's collectives (where the communicator takes one).
inline constexpr collective_tag consistency_tag{"data_parallel.verify_replicas"};

template <class Communicator, class T>
void gather_tagged(Communicator& comm, std::span<const T> send, std::span<T> recv) {
    if constexpr (requires { comm.all_gather(send, recv, consistency_tag); })
        comm.all_gather(send, recv, consistency_tag);
    else
        host_all_gather(comm, send, recv);
}

/// Every replica's digests of `sections` (row r: replica r's, one per section), on the host.
/// A host communicator gathers the host digests directly. Otherwise (nccl_communicator) the
/// digests stay in the communicator's memory: one digest pass, one all_gather, one read back
/// and one polled wait (wait_for: the communicator's timeout and failure checks), with every
/// allocation made before anything is enqueued.
template <class Communicator, class System, class T>
std::vector<std::int64_t> gathered_digests(Communicator& comm, const System& sys,
                                           const std::vector<consistency_section<T>>& sections) {
    const std::size_t count = sections.size() * static_cast<std::size_t>(comm.size());
    std::vector<std::int64_t> all(count);
    section_digests<System, T> digests(sys, sections);
    if constexpr (Communicator::system_type::is_host) {
        digests.enqueue();
        const std::span<const std::int64_t> d = digests.digests();
        const std::vector<std::int64_t> mine(d.begin(), d.end());
        gather_tagged(comm, std::span<const std::int64_t>(mine), std::span<std::int64_t>(all));
    } else {
        static_assert(std::is_same_v<System, typename Communicator::system_type>,
                      "verify_replicas compares tensors in the communicator's memory");
        buffer<std::int64_t, System> everyone(count, sys);
        staged_read<std::int64_t, System> back(count == 0 ? 1 : count, sys);
        digests.enqueue();
        comm.all_gather(digests.digests(), everyone.span());
        back.enqueue(std::span<const std::int64_t>(everyone.span()));
        const std::span<const std::int64_t> v =
            wait_for(comm, back, "data_parallel.verify_replicas");
        std::copy(v.begin(), v.end(), all.begin());
    }
    return all;
}

/// The replicas (of `n`) whose value at column `j` of the gathered rows (row r: replica r's
/// `width` values) differs from the reference value, the one most replicas hold (on a tie, the
/// lowest replica's). Empty when every replica agrees.
struct divergence {
    int reference = 0;          ///< a replica holding the reference value
    std::vector<int> differing; ///< replicas that hold another value
    std::vector<int> agreeing;  ///< replicas that hold the reference value
};

template <class V>
divergence divergence_at(const std::vector<V>& rows, std::size_t width, std::size_t j, int n) {
    const auto at = [&](int r) { return rows[static_cast<std::size_t>(r) * width + j]; };
    divergence d;
    int best = 0;
    for (int r = 0; r < n; ++r) {
        int same = 0;
        for (int q = 0; q < n; ++q)
            same += at(q) == at(r) ? 1 : 0;
        if (same > best) {
            best = same;
            d.reference = r;
        }
    }
    for (int r = 0; r < n; ++r)
        (at(r) == at(d.reference) ? d.agreeing : d.differing).push_back(r);
    return d;
}

inline std::string replica_list(const std::vector<int>& rs) {
    std::string s = rs.size() == 1 ? "replica " : "replicas ";
    for (std::size_t i = 0; i < rs.size(); ++i)
        s += (i == 0 ? "" : ", ") + std::to_string(rs[i]);
    return s;
}

/// "0.5 (bits 0x3f000000)".
template <class T>
std::string describe_element(T v) {
    char text[64];
    std::snprintf(text, sizeof text, "%.17g (bits 0x%0*llx)", static_cast<double>(v),
                  static_cast<int>(2 * sizeof(T)),
                  static_cast<unsigned long long>(element_bits(v)));
    return text;
}

/// The collective check of train_params::verify_every, on every replica of comm: the digests
/// of `sections` (in sys's memory) are all-gathered (gathered_digests: one all_gather of
/// sections.size() int64; on a device communicator one polled host wait in all).
/// When they agree it returns. Otherwise every replica takes the same two further all_gathers
/// (the per-block digests of the first differing tensor, then that block's elements) and throws
/// lockstep::error (errc::divergence, operation "data_parallel.verify_replicas") naming the
/// step (`step`: the index of the step just taken, as step_result::step), the differing replicas,
/// the tensor, the element and every replica's value there. requires: every replica passes the same
/// sections (names and sizes; the trainer's agreement check at construction guarantees it).
/// Collective.
template <class Communicator, class System, class T>
void verify_replicas(Communicator& comm, const System& sys, std::int64_t step,
                     const std::vector<consistency_section<T>>& sections) {
    const int n = comm.size(), me = comm.rank();
    const std::size_t s_count = sections.size();
    const std::vector<std::int64_t> all = gathered_digests(comm, sys, sections);
    std::size_t first = s_count;
    for (std::size_t s = 0; s < s_count && first == s_count; ++s)
        if (!divergence_at(all, s_count, s, n).differing.empty())
            first = s;
    if (first == s_count)
        return;

    // Every replica saw the same digests, so all of them locate the element together.
    const auto& sec = sections[first];
    const std::size_t size = sec.data.size();
    constexpr std::size_t block = 4096;
    const std::size_t blocks = (size + block - 1) / block;
    buffer<std::int64_t, System> block_digests(blocks, sys);
    thrust::transform(sys.policy(), thrust::counting_iterator<std::size_t>(0),
                      thrust::counting_iterator<std::size_t>(blocks), block_digests.data(),
                      block_digest_fn<T>{sec.data.data(), size, block});
    std::vector<std::int64_t> my_blocks(blocks), all_blocks(blocks * static_cast<std::size_t>(n));
    lockstep::copy(std::span<const std::int64_t>(block_digests.span()), sys,
                   std::span<std::int64_t>(my_blocks), host_system{1});
    gather_tagged(comm, std::span<const std::int64_t>(my_blocks),
                  std::span<std::int64_t>(all_blocks));
    std::size_t b = 0;
    while (b + 1 < blocks && divergence_at(all_blocks, blocks, b, n).differing.empty())
        ++b;
    const std::size_t lo = b * block, width = std::min(size, lo + block) - lo;
    std::vector<T> my_values(width), values(width * static_cast<std::size_t>(n));
    lockstep::copy(sec.data.subspan(lo, width), sys, std::span<T>(my_values), host_system{1});
    std::vector<std::uint64_t> bits(values.size());
    gather_tagged(comm, std::span<const T>(my_values), std::span<T>(values));
    for (std::size_t i = 0; i < values.size(); ++i)
        bits[i] = element_bits(values[i]);
    std::size_t e = 0;
    while (e + 1 < width && divergence_at(bits, width, e, n).differing.empty())
        ++e;
    // The replicas are named from the tensor digests (a difference the element search could
    // not place, which only a digest collision elsewhere could cause, still names them).
    const divergence d = divergence_at(all, s_count, first, n);
    std::string held;
    for (int r = 0; r < n; ++r)
        held += (r == 0 ? "" : ", ") + std::string("replica ") + std::to_string(r) + " " +
                describe_element(values[static_cast<std::size_t>(r) * width + e]);
    fail(errc::divergence, me, "data_parallel.verify_replicas", "after step ", step, " ",
         replica_list(d.differing), d.differing.size() == 1 ? " holds" : " hold",
         " other values than ", replica_list(d.agreeing), ": first in tensor '", sec.name, "' (",
         first + 1, " of ", s_count, " compared tensors, ", size, " elements) at element ", lo + e,
         ": ", held);
}

} // namespace lockstep::detail
