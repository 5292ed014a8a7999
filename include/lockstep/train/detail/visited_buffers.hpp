// lockstep/train/detail/visited_buffers.hpp: the visitor path of a trainer (path (b)): the tensors
// a network that owns its buffers declares (for_each_parameter, for_each_state) laid out flat, and
// the copies between its buffers and the trainer's flat ones. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/error.hpp"
#include "lockstep/core/span_overlap.hpp"
#include "lockstep/system/buffer.hpp"
#include "lockstep/train/detail/visit_check.hpp"
#include "lockstep/train/detail/visitor.hpp"
#include "lockstep/train/parameter_registry.hpp"
#include "lockstep/train/train_params.hpp"

#include <algorithm>
#include <cstddef>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace lockstep::detail {

/// The spans a visitor passed for one parameter tensor.
template <class T>
struct visited_spans {
    std::string name;
    std::span<T> values, grads;
    /// Visited again with the same two spans as `o` (a tied tensor, packed twice).
    bool ties(const visited_spans& o) const noexcept {
        return values.data() == o.values.data() && values.size() == o.values.size() &&
               grads.data() == o.grads.data() && grads.size() == o.grads.size();
    }
};

/// "" when no two of the visited spans share memory, except a tensor visited again with the same
/// two spans (a tied tensor); else the first overlap found (the tensors, sizes and addresses) and
/// the fix. The trainer zeroes the gradients and copies the values back every step, so values
/// that alias gradients, or two tensors over one buffer, would train silently wrong.
template <class T>
std::string visited_overlap(const std::vector<visited_spans<T>>& tensors) {
    struct piece {
        std::size_t tensor;
        bool grads;
        std::span<T> span;
    };
    std::vector<piece> pieces;
    for (std::size_t i = 0; i < tensors.size(); ++i)
        for (const bool grads : {false, true})
            if (const std::span<T> s = grads ? tensors[i].grads : tensors[i].values; !s.empty())
                pieces.push_back(piece{i, grads, s});
    // Sorted by address, a span overlaps an earlier one only if it overlaps the one reaching
    // furthest (stable: the first of two spans at one address is the one visited first).
    std::stable_sort(pieces.begin(), pieces.end(), [](const piece& a, const piece& b) {
        return std::less<const T*>{}(a.span.data(), b.span.data());
    });
    auto role = [&](const piece& p) {
        return concat("the ", p.grads ? "gradients" : "values", " of '", tensors[p.tensor].name,
                      "'");
    };
    for (std::size_t k = 1, far = 0; k < pieces.size(); ++k) {
        const piece& a = pieces[far];
        const piece& b = pieces[k];
        const bool tied = a.grads == b.grads && tensors[a.tensor].ties(tensors[b.tensor]);
        const std::string text =
            tied ? std::string() : overlap_text(a.span, role(a).c_str(), b.span, role(b).c_str());
        if (!text.empty())
            return concat(text, ": give every tensor its own value and gradient buffers, "
                                "f(name, values, gradients), disjoint from every other tensor's "
                                "(a tied tensor may be visited again with the same two spans)");
        if (std::less<const T*>{}(a.span.data() + a.span.size(), b.span.data() + b.span.size()))
            far = k;
    }
    return {};
}

/// Two parameter tensors (indices in the registry) that are one tied tensor visited twice.
using tied_pair = std::pair<std::size_t, std::size_t>;

/// Adds the parameters the network's for_each_parameter visits to `reg` (still open), with the
/// visitor's shape when it passes one (train_params::decay and frozen see it), and returns the
/// tied tensors (a tensor visited again with the same spans: registered, and packed, twice).
/// Throws lockstep::error naming replica `rank` when the network also allocated from the registry
/// (errc::invalid_argument), a tensor's gradients or shape do not match its values
/// (errc::shape_mismatch), or visited spans overlap (visited_overlap; errc::invalid_argument).
template <class T, class Network, class Registry>
std::vector<tied_pair> register_visited_parameters(Network& net, Registry& reg, int rank) {
    LOCKSTEP_REQUIRE(reg.empty(), errc::invalid_argument, rank, "data_parallel",
                     "the network both allocates from the registry and defines "
                     "for_each_parameter: use one of the two");
    std::vector<visited_spans<T>> visited;
    visit_parameters(net, [&](std::string_view name, std::span<T> v, std::span<T> g,
                              const std::vector<std::size_t>& shape) {
        LOCKSTEP_REQUIRE(v.size() == g.size(), errc::shape_mismatch, rank, "data_parallel",
                         "parameter '", name, "' has ", v.size(), " values but ", g.size(),
                         " gradients");
        visited.push_back(visited_spans<T>{std::string(name), v, g});
        if (shape.empty()) {
            reg.add(std::string(name), {v.size()});
            return;
        }
        // The visitor's shape is kept (train_params::decay and frozen see it).
        std::size_t n = 1;
        for (std::size_t e : shape)
            n = e != 0 && n > v.size() / e ? v.size() + 1 : n * e;
        LOCKSTEP_REQUIRE(n == v.size(), errc::shape_mismatch, rank, "data_parallel", "parameter '",
                         name, "': shape ", shape_string(shape), " does not hold its ", v.size(),
                         " values");
        reg.add(std::string(name), shape);
    });
    const std::string overlap = visited_overlap(visited);
    LOCKSTEP_REQUIRE(overlap.empty(), errc::invalid_argument, rank, "data_parallel",
                     "for_each_parameter: ", overlap);
    // No overlap but ties: a tied tensor's values start where its first visit's do.
    std::vector<tied_pair> ties;
    std::unordered_map<const T*, std::size_t> first;
    for (std::size_t i = 0; i < visited.size(); ++i) {
        const auto [at, fresh] = first.emplace(visited[i].values.data(), i);
        if (!fresh)
            ties.emplace_back(at->second, i);
    }
    return ties;
}

/// requires: the settings that act on a tensor's slot of the flat buffer act alike on a tied
/// tensor's two slots. Both get the same gradient and, decayed and frozen alike, the same update,
/// so unpacking them writes one value twice; with different frozen (or, trained, different decay)
/// the slot unpacked last would silently win, and max_grad_norm would count the tensor's gradient
/// twice in the norm (a frozen one's gradient is zeroed before the norm).
/// Else lockstep::error (errc::unsupported for clipping, errc::invalid_argument for the sets),
/// at construction, naming the replica, both names and the fix.
inline void check_tied_tensors(std::span<const tied_pair> ties, std::span<const tensor_info> params,
                               const train_params& tp, int rank) {
    const auto in = [](const std::function<bool(const tensor_info&)>& set, const tensor_info& t,
                       bool empty) { return set ? set(t) : empty; };
    for (const auto& [first, again] : ties) {
        const tensor_info& a = params[first];
        const tensor_info& b = params[again];
        const bool frozen_a = in(tp.frozen, a, false), frozen_b = in(tp.frozen, b, false);
        LOCKSTEP_REQUIRE(tp.max_grad_norm == 0 || (frozen_a && frozen_b), errc::unsupported, rank,
                         "data_parallel", "max_grad_norm = ", tp.max_grad_norm, " with '", b.name,
                         "' visited again with the spans of '", a.name,
                         "' (a tied tensor): its gradient would count twice in the norm; visit a "
                         "tied tensor once, or clip in a gradient hook");
        const bool decay_a = in(tp.decay, a, true), decay_b = in(tp.decay, b, true);
        const bool by_frozen = frozen_a != frozen_b;
        const auto text = [](bool v) { return v ? "true" : "false"; };
        LOCKSTEP_REQUIRE(!by_frozen && (frozen_a || decay_a == decay_b), errc::invalid_argument,
                         rank, "data_parallel", "'", b.name, "' is visited with the spans of '",
                         a.name,
                         "' (a tied tensor) but train_params::", by_frozen ? "frozen" : "decay",
                         " is ", text(by_frozen ? frozen_a : decay_a), " for '", a.name, "' and ",
                         text(by_frozen ? frozen_b : decay_b), " for '", b.name,
                         "': the update unpacked last would win; give both names the same answer");
    }
}

/// Which copy copy_visited makes between a network's parameter buffers and the flat ones.
enum class visited_copy {
    grads_to_flat,  ///< network gradients -> flat gradients
    values_to_flat, ///< network values -> flat values
    flat_to_values, ///< flat values -> network values
};

/// The copy `dir` between the network's parameter buffers and the flat ones (`flat`: the
/// registry's gradients or values, laid out as `declared`, its parameters()), enqueued on `sys`.
/// requires: the visitor visits the tensors it declared at construction (visit_check), else
/// lockstep::error (errc::shape_mismatch) naming replica `rank` and the tensor.
template <class T, class Network, class System>
void copy_visited(Network& net, std::span<const tensor_info> declared, std::span<T> flat,
                  const System& sys, int rank, visited_copy dir) {
    visit_check seen(declared, rank, "for_each_parameter");
    visit_parameters(net, [&](std::string_view name, std::span<T> v, std::span<T> g) {
        const std::span<T> mine = dir == visited_copy::grads_to_flat ? g : v;
        const tensor_info& t = seen.next(name, mine.size());
        const std::span<T> theirs = flat.subspan(t.offset, t.size);
        if (dir == visited_copy::flat_to_values)
            copy_async(sys, std::span<const T>(theirs), mine);
        else
            copy_async(sys, std::span<const T>(mine), theirs);
    });
    seen.done();
}

/// The state a network visits (for_each_state, with either path: e.g. BN running statistics a
/// layer owns), packed into a buffer of the trainer's so that it is broadcast, averaged and
/// checkpointed like the registry's state.
template <class T, class System>
class visited_state {
public:
    visited_state() = default;

    /// Lays out the state `net` visits now, in visiting order, and allocates its packed buffer.
    template <class Network>
    visited_state(Network& net, const System& sys) {
        std::size_t offset = 0;
        visit_state<T>(net, [&](std::string_view name, std::span<T> st) {
            tensors_.push_back(
                tensor_info{std::string(name), {st.size()}, offset, st.size(), tensor_kind::state});
            offset += st.size();
        });
        flat_ = buffer<T, System>(offset, sys);
    }

    /// The state tensors as laid out in the packed buffer.
    const std::vector<tensor_info>& tensors() const noexcept { return tensors_; }
    /// The packed buffer (empty when the network visits no state).
    std::span<T> span() noexcept { return flat_.span(); }
    bool empty() const noexcept { return flat_.empty(); }

    /// Network state -> packed buffer (`pack`), or back, enqueued on `sys`. requires: the
    /// network visits the state it visited at construction (visit_check), else lockstep::error
    /// (errc::shape_mismatch) naming replica `rank` and the tensor.
    template <class Network>
    void move(Network& net, const System& sys, int rank, bool pack) {
        if constexpr (has_state_visitor<Network, T>) {
            visit_check seen(tensors_, rank, "for_each_state");
            visit_state<T>(net, [&](std::string_view name, std::span<T> s) {
                const tensor_info& t = seen.next(name, s.size());
                std::span<T> flat = flat_.span().subspan(t.offset, t.size);
                if (pack)
                    copy_async(sys, std::span<const T>(s), flat);
                else
                    copy_async(sys, std::span<const T>(flat), s);
            });
            seen.done();
        }
        (void)net;
        (void)sys;
        (void)rank;
        (void)pack;
    }

private:
    std::vector<tensor_info> tensors_;
    buffer<T, System> flat_;
};

} // namespace lockstep::detail
