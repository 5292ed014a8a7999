// lockstep/comm/detail/shm_call.hpp: call_record, what one replica of a thread group passed to
// one collective (published for its peers to check and read), and how messages name it.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/communicator.hpp"
#include "lockstep/comm/detail/shm_reduce.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace lockstep::detail::shm {

class group_state;

/// Which collective a replica called.
enum class collective_kind : unsigned char {
    barrier,
    broadcast,
    all_gather,
    all_reduce,
    reduce,
    split,
    all_to_all,
    reduce_scatter,
    all_combine
};

inline const char* name_of(collective_kind k) noexcept {
    switch (k) {
    case collective_kind::barrier:
        return "barrier";
    case collective_kind::broadcast:
        return "broadcast";
    case collective_kind::all_gather:
        return "all_gather";
    case collective_kind::all_reduce:
        return "all_reduce";
    case collective_kind::reduce:
        return "reduce";
    case collective_kind::split:
        return "split";
    case collective_kind::all_to_all:
        return "all_to_all";
    case collective_kind::reduce_scatter:
        return "reduce_scatter";
    case collective_kind::all_combine:
        return "all_combine";
    }
    return "collective";
}

/// What one replica passed to one collective; published before the first phase, read by the
/// peers after it (the phase's release/acquire orders the plain fields).
struct call_record {
    collective_kind kind = collective_kind::barrier;
    element_type type = element_type::bytes;
    std::size_t elem_size = 0;
    std::size_t count = 0;      ///< elements sent (broadcast: elements of data)
    std::size_t recv_count = 0; ///< elements of the receive span
    int root = 0;
    reduce_op op = reduce_op::sum;
    int color = 0;
    int key = 0;
    const void* send = nullptr;
    void* recv = nullptr;
    /// all_combine: the replica's `arrays` input arrays of `count` elements (send is unused).
    const void* const* arrays = nullptr;
    std::size_t array_count = 0;
    std::shared_ptr<group_state> child; ///< split: the new group, published by its leader
    /// reduce_scatter: a copy of the per-rank counts (a copy, because a peer may still read
    /// the record after this replica has returned from a one-phase collective); empty for the
    /// other collectives.
    std::vector<std::size_t> counts;
    /// reduce_scatter: the entries of a null counts span (then nothing is copied), else 0.
    std::size_t null_counts = 0;
    /// What is wrong with this replica's own arguments ("" when nothing): a null span with a
    /// non-zero count, or more elements than memory can hold. Every member then throws it.
    std::string problem;
    /// The call's identity (collective_tag::identity: its name, its call site, or "" for
    /// none), compared with the collective.
    std::string tag;
    /// True when `tag` is a call site ("train.cpp:42"), false when it is a name.
    bool tag_is_site = false;
};

/// "all_reduce #7 (4 floats, sum, tag 'bucket 2')": one replica's call, for messages.
inline std::string describe_call(const call_record& c, std::uint64_t seq) {
    std::string s = std::string(name_of(c.kind)) + " #" + std::to_string(seq);
    std::string args;
    if (c.kind != collective_kind::barrier && c.kind != collective_kind::split)
        args = count_of(c.count, c.type, c.elem_size);
    if (c.kind == collective_kind::all_reduce || c.kind == collective_kind::reduce ||
        c.kind == collective_kind::reduce_scatter)
        args += ", " + std::string(to_string(c.op));
    if (c.kind == collective_kind::broadcast || c.kind == collective_kind::reduce)
        args += ", root " + std::to_string(c.root);
    if (!c.tag.empty())
        args += (args.empty() ? "" : ", ") +
                (c.tag_is_site ? "at " + c.tag : std::string("tag '") + c.tag + "'");
    return args.empty() ? s : s + " (" + args + ")";
}

/// What is wrong with the spans of `c` (see call_record::problem), "" when they are usable.
inline std::string record_problem(const call_record& c) {
    const std::size_t limit =
        static_cast<std::size_t>(PTRDIFF_MAX) / std::max<std::size_t>(1, c.elem_size);
    const auto check = [&](const void* p, std::size_t n, const char* what) -> std::string {
        if (p == nullptr && n != 0)
            return std::string("a null ") + what + " span of " + std::to_string(n) + " elements";
        if (n > limit)
            return std::string("a ") + what + " span of " + std::to_string(n) + " elements of " +
                   std::to_string(c.elem_size) + " bytes, more than memory can hold (at most " +
                   std::to_string(limit) + ")";
        return {};
    };
    std::string a;
    if (c.kind == collective_kind::all_combine) {
        if (c.arrays == nullptr && c.array_count != 0)
            a = "a null span of " + std::to_string(c.array_count) + " input arrays";
        for (std::size_t k = 0; a.empty() && c.arrays != nullptr && k < c.array_count; ++k)
            a = check(c.arrays[k], c.count, ("input array " + std::to_string(k)).c_str());
    } else {
        a = check(c.send, c.count, "send");
    }
    std::string b = check(c.recv, c.recv_count, "receive");
    if (c.null_counts != 0)
        b += (b.empty() ? "" : " and ") + std::string("a null counts span of ") +
             std::to_string(c.null_counts) + " entries";
    if (!a.empty() && !b.empty())
        return a + " and " + b;
    return a.empty() ? b : a;
}

/// Names one collective call in messages ("all_reduce #3"); formatted only when an error is.
struct op_label {
    const char* name;
    std::uint64_t seq;
};

} // namespace lockstep::detail::shm
