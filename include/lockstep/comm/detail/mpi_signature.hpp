// lockstep/comm/detail/mpi_signature.hpp: the signature replicas exchange before a verified
// collective, and the errors when they disagree. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/communicator.hpp"
#include "lockstep/comm/detail/mpi_types.hpp"
#include "lockstep/core/error.hpp"

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include <mpi.h>

namespace lockstep::detail {

/// The collectives a signature can name.
enum class mpi_collective : std::int64_t {
    none = 0,
    all_reduce,
    broadcast,
    all_gather,
    reduce,
    barrier,
    split,
    all_to_all,
    reduce_scatter,
    all_to_all_others
};

constexpr std::string_view to_string(mpi_collective c) noexcept {
    switch (c) {
    case mpi_collective::none:
        return "none";
    case mpi_collective::all_reduce:
        return "all_reduce";
    case mpi_collective::broadcast:
        return "broadcast";
    case mpi_collective::all_gather:
        return "all_gather";
    case mpi_collective::reduce:
        return "reduce";
    case mpi_collective::barrier:
        return "barrier";
    case mpi_collective::split:
        return "split";
    case mpi_collective::all_to_all:
        return "all_to_all";
    case mpi_collective::reduce_scatter:
        return "reduce_scatter";
    case mpi_collective::all_to_all_others:
        return "all_to_all_others";
    }
    return "unknown";
}

/// What every replica must agree on before a collective runs. Fields that do not apply are 0
/// (root and op of an all_gather); `arguments_ok` is 0 on a replica whose own arguments failed
/// a local check, so the others are released with an error instead of waiting for it;
/// `layout` is a positive hash of reduce_scatter's per-rank counts (counts_hash); `tag` is the
/// caller's collective_tag::id() (0 for none).
struct mpi_signature {
    enum field : std::size_t { kind, sequence, count, type, root, op, arguments_ok, layout, tag };
    static constexpr std::size_t size = 9; ///< the number of fields
    std::array<std::int64_t, size> value{};
};

/// The element-wise minimum and maximum of every replica's signature, from one MPI_Allreduce
/// with MPI_MAX over {v, -v}: max(-v) = -min(v), so one call of 2 * size int64 gives both.
struct mpi_signature_range {
    mpi_signature min, max;
    bool agree(mpi_signature::field f) const noexcept { return min.value[f] == max.value[f]; }
};

/// The 2 * size int64 one replica contributes to the MPI_MAX exchange: {v, -v}.
inline std::array<std::int64_t, 2 * mpi_signature::size>
mpi_signature_pack(const mpi_signature& mine) noexcept {
    constexpr std::size_t k = mpi_signature::size;
    std::array<std::int64_t, 2 * k> v{};
    std::copy(mine.value.begin(), mine.value.end(), v.begin());
    std::transform(mine.value.begin(), mine.value.end(), v.begin() + k,
                   [](std::int64_t x) { return -x; });
    return v;
}

/// The range of every replica's signature, from the MPI_MAX of their packed signatures.
inline mpi_signature_range
mpi_signature_unpack(const std::array<std::int64_t, 2 * mpi_signature::size>& v) noexcept {
    constexpr std::size_t k = mpi_signature::size;
    mpi_signature_range out;
    std::copy(v.begin(), v.begin() + k, out.max.value.begin());
    std::transform(v.begin() + k, v.end(), out.min.value.begin(),
                   [](std::int64_t x) { return -x; });
    return out;
}

/// "all_reduce #12": a collective and its sequence number, for messages.
inline std::string mpi_operation_name(mpi_collective kind, std::int64_t sequence) {
    return std::string(to_string(kind)) + " #" + std::to_string(sequence);
}

/// The bytes of one replica's call description in the all-gather that follows a mismatch of
/// collectives or tags (longer descriptions are cut).
inline constexpr std::size_t mpi_call_text_bytes = 200;

/// "all_reduce #7 (4 float, sum, tag 'bucket 2')": this replica's call, for messages. tag: the
/// call's identity (collective_tag::identity); tag_is_site: it is a call site ("at f.cpp:42").
inline std::string mpi_describe_call(const mpi_signature& s, std::string_view tag,
                                     bool tag_is_site = false) {
    using f = mpi_signature;
    const auto kind = mpi_collective(s.value[f::kind]);
    std::string out = mpi_operation_name(kind, s.value[f::sequence]);
    std::string args;
    if (kind != mpi_collective::barrier && kind != mpi_collective::split)
        args =
            std::to_string(s.value[f::count]) + " " + std::string(mpi_type_name(s.value[f::type]));
    if (kind == mpi_collective::all_reduce || kind == mpi_collective::reduce ||
        kind == mpi_collective::reduce_scatter)
        args += ", " + std::string(to_string(reduce_op(s.value[f::op])));
    if (kind == mpi_collective::broadcast || kind == mpi_collective::reduce)
        args += ", root " + std::to_string(s.value[f::root]);
    if (!tag.empty())
        args += (args.empty() ? "" : ", ") +
                (tag_is_site ? "at " + std::string(tag) : "tag '" + std::string(tag) + "'");
    return args.empty() ? out : out + " (" + args + ")";
}

/// True when the replicas called different collectives or passed different tags (and none
/// failed its own checks): then every replica all-gathers its call's description before
/// require_agreement. The same on every replica, since every replica sees the same range.
inline bool mpi_calls_differ(const mpi_signature_range& r) noexcept {
    return r.min.value[mpi_signature::arguments_ok] != 0 &&
           (!r.agree(mpi_signature::kind) || !r.agree(mpi_signature::tag));
}

/// Throws lockstep::error when the replicas' signatures disagree. Every replica sees the same
/// range, so every replica throws, with the same code: peer_failure when a replica's own
/// arguments failed (that replica reports them itself), invalid_argument for different
/// sequence numbers, roots or reductions, count_mismatch for counts (and for reduce_scatter's
/// per-rank counts, described by `layout_text` for this replica) and shape_mismatch for
/// different collectives, element types and tags (the thread group's codes for the same
/// mistakes). `calls` lists every replica's call when
/// mpi_calls_differ ("replica 0 called ..., replica 1 called ..."). `tag_text` (detail::tag_text)
/// follows the collective's name in the messages after the tags agree. `label`: the split's
/// ("split(color=1)", "" for the whole group), named after the collective.
inline void require_agreement(const mpi_signature& mine, const mpi_signature_range& r, int rank,
                              const std::string& layout_text = {}, const std::string& calls = {},
                              const std::string& tag_text = {}, const std::string& label = {}) {
    using f = mpi_signature;
    const auto& lo = r.min.value;
    const auto& hi = r.max.value;
    const auto name = [&] {
        return mpi_operation_name(mpi_collective(mine.value[f::kind]), mine.value[f::sequence]) +
               (label.empty() ? "" : " in " + label);
    };
    // Every replica passed this tag once the tags agree.
    const auto tagged = [&] { return name() + tag_text; };
    if (lo[f::arguments_ok] == 0)
        fail(errc::peer_failure, rank, name(),
             "another replica's arguments failed its checks (it reports them); this replica "
             "was released instead of waiting");
    if (!r.agree(f::kind))
        fail(errc::shape_mismatch, rank, name(),
             "replicas called different collectives at this point (a call swapped, skipped or "
             "added on some replica): ",
             calls);
    if (!r.agree(f::tag))
        fail(errc::shape_mismatch, rank, name(),
             "replicas passed different collective tags or call sites (a call swapped, skipped "
             "or added on some replica): ",
             calls);
    if (!r.agree(f::sequence))
        fail(errc::invalid_argument, rank, tagged(), "replicas are at collective #",
             lo[f::sequence], " to #", hi[f::sequence],
             ": one of them skipped or repeated a collective");
    if (!r.agree(f::count))
        fail(errc::count_mismatch, rank, tagged(), "replicas passed different counts: min ",
             lo[f::count], ", max ", hi[f::count], " (this replica ", mine.value[f::count], ")");
    if (!r.agree(f::layout))
        fail(errc::count_mismatch, rank, tagged(),
             "replicas passed different per-rank counts (this replica ", layout_text, ")");
    if (!r.agree(f::type))
        fail(errc::shape_mismatch, rank, tagged(),
             "replicas passed different element types: ", mpi_type_name(lo[f::type]), " and ",
             mpi_type_name(hi[f::type]));
    if (!r.agree(f::root))
        fail(errc::invalid_argument, rank, tagged(), "replicas passed different roots: min ",
             lo[f::root], ", max ", hi[f::root]);
    if (!r.agree(f::op))
        fail(errc::invalid_argument, rank, tagged(),
             "replicas passed different reductions: ", to_string(reduce_op(lo[f::op])), " and ",
             to_string(reduce_op(hi[f::op])));
}

} // namespace lockstep::detail
