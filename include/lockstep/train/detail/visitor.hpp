// lockstep/train/detail/visitor.hpp: detection and invocation of the network visitor
// customization points for_each_parameter / for_each_state (member or found by ADL).
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <cstddef>
#include <span>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

namespace lockstep::detail {

/// Visitor shapes the customization points are probed with. A parameter visitor calls
/// f(name, values, gradients) or f(name, values, gradients, shape) (shape: the tensor's extents,
/// e.g. `{out, in}`, whose product is values.size()).
template <class T>
struct parameter_probe {
    void operator()(std::string_view, std::span<T>, std::span<T>) const {}
    void operator()(std::string_view, std::span<T>, std::span<T>,
                    const std::vector<std::size_t>&) const {}
};
template <class T>
struct state_probe {
    void operator()(std::string_view, std::span<T>) const {}
};

namespace adl {
// Poison pills: ordinary lookup stops here, so only members and ADL candidates are found.
void for_each_parameter() = delete;
void for_each_state() = delete;

template <class N, class F>
concept adl_parameters = requires(N& n, F f) {
    for_each_parameter(n, f);
};
template <class N, class F>
concept adl_state = requires(N& n, F f) {
    for_each_state(n, f);
};

template <class N, class F>
void call_parameters(N& n, F&& f) {
    for_each_parameter(n, std::forward<F>(f));
}
template <class N, class F>
void call_state(N& n, F&& f) {
    for_each_state(n, std::forward<F>(f));
}
} // namespace adl

template <class N, class F>
concept member_parameters = requires(N& n, F f) {
    n.for_each_parameter(f);
};
template <class N, class F>
concept member_state = requires(N& n, F f) {
    n.for_each_state(f);
};

/// True when Network exposes its parameters through the visitor (path (b)).
template <class N, class T>
concept has_parameter_visitor =
    member_parameters<N, parameter_probe<T>> || adl::adl_parameters<N, parameter_probe<T>>;
/// True when Network exposes state buffers through the visitor.
template <class N, class T>
concept has_state_visitor = member_state<N, state_probe<T>> || adl::adl_state<N, state_probe<T>>;

/// What visit_parameters hands the network: accepts the visitor's call with or without a
/// shape and forwards it to f, with the shape only when f takes one.
template <class F>
struct shape_adapter {
    F& f;
    template <class V>
    void operator()(std::string_view name, V values, V grads) const {
        if constexpr (std::is_invocable_v<F&, std::string_view, V, V>)
            f(name, values, grads);
        else
            f(name, values, grads, std::vector<std::size_t>{});
    }
    template <class V>
    void operator()(std::string_view name, V values, V grads,
                    const std::vector<std::size_t>& shape) const {
        if constexpr (std::is_invocable_v<F&, std::string_view, V, V,
                                          const std::vector<std::size_t>&>)
            f(name, values, grads, shape);
        else
            f(name, values, grads);
    }
};

/// Calls the network's parameter visitor (member first, then ADL). f takes (name, values,
/// gradients) or also the shape (empty when the network passed none).
template <class N, class F>
void visit_parameters(N& n, F&& f) {
    const shape_adapter<std::remove_reference_t<F>> a{f};
    if constexpr (member_parameters<N, shape_adapter<std::remove_reference_t<F>>>)
        n.for_each_parameter(a);
    else
        adl::call_parameters(n, a);
}
/// Calls the network's state visitor when it has one.
template <class T, class N, class F>
void visit_state(N& n, F&& f) {
    if constexpr (has_state_visitor<N, T>) {
        if constexpr (member_state<N, F>)
            n.for_each_state(std::forward<F>(f));
        else
            adl::call_state(n, std::forward<F>(f));
    }
}

} // namespace lockstep::detail
