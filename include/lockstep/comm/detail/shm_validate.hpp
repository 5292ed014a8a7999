// lockstep/comm/detail/shm_validate.hpp: validate_calls, the check every thread-group collective
// makes after its rendezvous that all members made the same call with usable spans.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/collective_tag.hpp"
#include "lockstep/comm/communicator.hpp"
#include "lockstep/comm/detail/scatter_counts.hpp"
#include "lockstep/comm/detail/shm_call.hpp"
#include "lockstep/comm/detail/shm_group.hpp"
#include "lockstep/core/checked_math.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/core/span_overlap.hpp"

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>

namespace lockstep::detail::shm {

/// validate_calls's part for reduce_scatter, after kinds, types and send counts agree: equal
/// per-rank counts, one per member, summing to the send count; each receive span this member's
/// slice of its send span or disjoint from it. op() names the call in messages.
template <class Name>
void validate_scatter(const group_state& g, int rank, op_label label, const Name& op) {
    const std::uint64_t seq = label.seq;
    const int me = g.replica_of(rank);
    const int n = g.size();
    const call_record& c0 = g.call(0, seq);
    for (int j = 1; j < n; ++j)
        if (g.call(j, seq).counts != c0.counts) {
            std::string s;
            for (int q = 0; q < n; ++q)
                s += (q == 0 ? "" : ", ") + std::string("replica ") +
                     std::to_string(g.replica_of(q)) + " passed counts " +
                     describe_counts(g.call(q, seq).counts);
            fail(errc::count_mismatch, me, op(), "replicas disagree on the per-rank counts: ", s);
        }
    // Counts agree from here, so every replica throws the same error or none does.
    const std::span<const std::size_t> counts = c0.counts;
    const auto layout = scatter_layout_of(counts, 0);
    if (counts.size() != static_cast<std::size_t>(n))
        fail(errc::count_mismatch, me, op(), "every replica passed ", counts.size(), " counts ",
             describe_counts(counts), " for a group of ", n, " replicas (one count per rank)");
    if (layout.overflow || layout.total != c0.count)
        fail(errc::count_mismatch, me, op(), "the counts ", describe_counts(counts),
             layout.overflow ? std::string(" overflow std::size_t")
                             : " sum to " + std::to_string(layout.total),
             " but every replica sends ", count_of(c0.count, c0.type, c0.elem_size));
    for (int j = 0; j < n; ++j) {
        const call_record& c = g.call(j, seq);
        const auto at = scatter_layout_of(c.counts, j);
        const auto s0 = reinterpret_cast<std::uintptr_t>(c.send);
        const auto r0 = reinterpret_cast<std::uintptr_t>(c.recv);
        const bool in_place = r0 == s0 + at.offset * c.elem_size;
        const bool overlap =
            c.recv_count == at.mine &&
            bytes_overlap(c.send, c.count * c.elem_size, c.recv, at.mine * c.elem_size);
        if (overlap && !in_place)
            fail(errc::invalid_argument, me, op(), "replica ", g.replica_of(j),
                 " passed a receive span that overlaps its send span but is not its own slice "
                 "of it (elements ",
                 at.offset, " to ", at.offset + at.mine, ")");
    }
}

/// Checks that every member of `g` made the same call at `label.seq` (same collective, element
/// type, count, reduction, root; receive spans of the right size). Every member reads the same
/// records, so all of them throw the same error or none does.
inline void validate_calls(const group_state& g, int rank, op_label label) {
    const std::uint64_t seq = label.seq;
    const auto op = [&] { return g.operation(label); };
    const int me = g.replica_of(rank);
    const int n = g.size();
    for (int j = 0; j < n; ++j)
        if (!g.call(j, seq).problem.empty())
            fail(errc::invalid_argument, me, op(), "replica ", g.replica_of(j), " passed ",
                 g.call(j, seq).problem, " to ", name_of(g.call(j, seq).kind),
                 "; nothing was communicated and the group stays usable");
    const call_record& c0 = g.call(0, seq);
    const auto list = [&](auto&& describe) {
        std::string s;
        for (int j = 0; j < n; ++j) {
            if (j > 0)
                s += ", ";
            s += "replica " + std::to_string(g.replica_of(j)) + " " + describe(g.call(j, seq));
        }
        return s;
    };
    const auto all_same = [&](auto&& field) {
        for (int j = 1; j < n; ++j)
            if (!(field(g.call(j, seq)) == field(c0)))
                return false;
        return true;
    };
    // A swapped, skipped or extra call shows here as another collective or tag at this
    // sequence number; every replica's whole call is named so the two sides can be found.
    if (!all_same([](const call_record& c) {
            return std::tuple(c.kind, std::string_view(c.tag), c.tag_is_site);
        }))
        fail(errc::shape_mismatch, me, op(),
             "replicas called different collectives, tags or call sites (a call swapped, "
             "skipped or added on some replica): ",
             list([&](const call_record& c) { return "called " + describe_call(c, seq); }));
    // Every replica passed the same tag from here: name it with the collective, so a
    // disagreement points at the caller ("all_gather #0 ('batch_norm.forward_train')").
    const auto tagged = [&] { return op() + tag_text(c0.tag, c0.tag_is_site); };
    const collective_kind k = c0.kind;
    if (k == collective_kind::barrier || k == collective_kind::split)
        return;

    const auto passed = [](const call_record& c) {
        return "passed " + count_of(c.count, c.type, c.elem_size);
    };
    if (!all_same([](const call_record& c) { return std::pair(c.type, c.elem_size); }))
        fail(errc::shape_mismatch, me, tagged(),
             "replicas disagree on the element type: ", list(passed));
    if (!all_same([](const call_record& c) { return c.count; }))
        fail(errc::count_mismatch, me, tagged(),
             "replicas disagree on the element count: ", list(passed));
    if (k == collective_kind::all_reduce || k == collective_kind::reduce ||
        k == collective_kind::reduce_scatter) {
        for (int j = 0; j < n; ++j)
            if (!is_reduce_op(g.call(j, seq).op))
                fail(errc::invalid_argument, me, tagged(), "replica ", g.replica_of(j),
                     " passed reduce_op value ", static_cast<int>(g.call(j, seq).op),
                     ", which is none of reduce_op::sum, max and min (an integer cast to "
                     "reduce_op?); nothing was communicated and the group stays usable");
        if (!all_same([](const call_record& c) { return c.op; }))
            fail(errc::shape_mismatch, me, tagged(),
                 "replicas disagree on the reduction: ", list([](const call_record& c) {
                     return "passed reduce_op::" + std::string(to_string(c.op));
                 }));
    }
    if (k == collective_kind::broadcast || k == collective_kind::reduce) {
        if (!all_same([](const call_record& c) { return c.root; }))
            fail(errc::shape_mismatch, me, tagged(),
                 "replicas disagree on the root: ", list([](const call_record& c) {
                     return "passed root " + std::to_string(c.root);
                 }));
        LOCKSTEP_REQUIRE(c0.root >= 0 && c0.root < n, errc::invalid_argument, me, tagged(), "root ",
                         c0.root, " is not a rank of this group of ", n);
    }
    if (k == collective_kind::all_to_all) {
        // Counts agree (checked above), so every replica throws the same error or none does.
        if (c0.count % static_cast<std::size_t>(n) != 0)
            fail(errc::count_mismatch, me, tagged(), "every replica passed ",
                 count_of(c0.count, c0.type, c0.elem_size),
                 ", which is not a whole number of blocks for ", n, " replicas");
        for (int j = 0; j < n; ++j) {
            const call_record& c = g.call(j, seq);
            const std::size_t bytes = c.count * c.elem_size;
            if (c.recv_count == c.count && bytes_overlap(c.send, bytes, c.recv, bytes))
                fail(errc::invalid_argument, me, tagged(), "replica ", g.replica_of(j),
                     " passed overlapping send and receive spans (all_to_all has no in-place "
                     "form)");
        }
    }
    if (k == collective_kind::all_combine) {
        if (!all_same([](const call_record& c) { return c.array_count; }))
            fail(
                errc::shape_mismatch, me, tagged(),
                "replicas disagree on the number of input arrays: ", list([](const call_record& c) {
                    return "passed " + std::to_string(c.array_count);
                }));
        LOCKSTEP_REQUIRE(c0.array_count >= 1, errc::invalid_argument, me, tagged(),
                         "every replica passed 0 input arrays (all_combine needs at least 1)");
    }
    if (k == collective_kind::reduce_scatter)
        validate_scatter(g, rank, label, tagged);
    for (int j = 0; j < n; ++j) {
        const call_record& c = g.call(j, seq);
        std::size_t want = c.recv_count;
        if (k == collective_kind::reduce_scatter)
            want = c.counts[static_cast<std::size_t>(j)];
        if (k == collective_kind::all_reduce || k == collective_kind::all_to_all ||
            k == collective_kind::all_combine)
            want = c.count;
        if (k == collective_kind::reduce && j == c.root)
            want = c.count;
        if (k == collective_kind::all_gather &&
            mul_overflows(c.count, static_cast<std::size_t>(n), &want))
            fail(errc::count_mismatch, me, tagged(), "replica ", g.replica_of(j), " passed ",
                 count_of(c.count, c.type, c.elem_size), ": ", n,
                 " times that overflows std::size_t");
        if (c.recv_count != want)
            fail(errc::count_mismatch, me, tagged(), "replica ", g.replica_of(j),
                 " passed a receive span of ", count_of(c.recv_count, c.type, c.elem_size), " for ",
                 count_of(want, c.type, c.elem_size));
    }
    // Sizes agree now. Send and recv may only overlap in the documented in-place form: every
    // replica reads every record, so all throw the same error or none does.
    if (k == collective_kind::all_reduce || k == collective_kind::reduce ||
        k == collective_kind::all_gather) {
        for (int j = 0; j < n; ++j) {
            const call_record& c = g.call(j, seq);
            if (k == collective_kind::reduce && j != c.root)
                continue; // recv is not touched off the root
            const std::size_t send_bytes = c.count * c.elem_size;
            // all_gather's in-place send is recv's slot rank(); the others' is recv itself.
            const std::uintptr_t in_place =
                reinterpret_cast<std::uintptr_t>(c.recv) +
                (k == collective_kind::all_gather ? static_cast<std::size_t>(j) * send_bytes : 0);
            if (bytes_overlap(c.send, send_bytes, c.recv, c.recv_count * c.elem_size) &&
                reinterpret_cast<std::uintptr_t>(c.send) != in_place)
                fail(errc::invalid_argument, me, tagged(), "replica ", g.replica_of(j),
                     " passed send and receive spans that overlap partially (",
                     k == collective_kind::all_gather
                         ? "in place, send must be exactly the rank()-th slice of recv"
                         : "in place, send must be exactly recv",
                     ")");
        }
    }
}

} // namespace lockstep::detail::shm
