// lockstep/train/parameter_registry.hpp: parameter_registry<T, System>, the flat zero-copy storage
// a network allocates its parameters, gradients and state from. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/checked_math.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/system/buffer.hpp"
#include "lockstep/system/host_system.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace lockstep {

/// What a registered tensor is: a trainable parameter (value + gradient, reduced and updated)
/// or state (a value only: BN running statistics, step counters; broadcast, never reduced).
enum class tensor_kind { parameter, state };

/// The description of one registered tensor: its place in the registry's flat buffer.
struct tensor_info {
    std::string name;
    std::vector<std::size_t> shape;
    std::size_t offset = 0; ///< first element in the flat buffer of its kind
    std::size_t size = 0;   ///< number of elements (the product of shape)
    tensor_kind kind = tensor_kind::parameter;
};

/// "{3, 4}": a shape as text, for error messages.
inline std::string shape_string(const std::vector<std::size_t>& shape) {
    std::string s = "{";
    for (std::size_t i = 0; i < shape.size(); ++i)
        s += (i ? ", " : "") + std::to_string(shape[i]);
    return s + "}";
}

template <class T, class System>
class parameter_registry;

/// A light handle on one registered tensor (two words; copy it freely). It resolves to spans in
/// the registry's storage on every call, so it stays valid across finalize(). The registry must
/// outlive the handle and must not move (data_parallel keeps it at a fixed address).
template <class T, class System = host_system>
class tensor_handle {
public:
    tensor_handle() = default;
    tensor_handle(parameter_registry<T, System>* reg, tensor_kind kind, std::size_t index)
        : reg_(reg), kind_(kind), index_(index) {}

    /// The tensor's values. Before finalize(): host staging memory (initialise it there, the
    /// registry copies it into the flat buffer); after: the flat buffer in System's memory.
    /// requires (here and for every accessor below but kind(), index(), valid()): valid(), else
    /// lockstep::error (errc::invalid_argument).
    std::span<T> value() const { return registry("tensor_handle.value").value(*this); }
    /// The tensor's gradient in the flat gradient buffer. requires: a parameter, finalized.
    std::span<T> grad() const { return registry("tensor_handle.grad").grad(*this); }
    const tensor_info& info() const { return registry("tensor_handle.info").info(*this); }
    const std::string& name() const { return info().name; }
    const std::vector<std::size_t>& shape() const { return info().shape; }
    std::size_t size() const { return info().size; }
    tensor_kind kind() const noexcept { return kind_; }
    /// Registration index among the tensors of its kind.
    std::size_t index() const noexcept { return index_; }
    /// False for a default-constructed handle (it names no tensor).
    bool valid() const noexcept { return reg_ != nullptr; }
    /// Whether the handle names a tensor of `reg` (not of another model's registry).
    bool belongs_to(const parameter_registry<T, System>& reg) const noexcept {
        return reg_ == &reg;
    }

private:
    // One pointer test per call: value() and grad() run once per tensor per step at most.
    parameter_registry<T, System>& registry(const char* op) const {
        LOCKSTEP_REQUIRE(reg_ != nullptr, errc::invalid_argument, -1, op,
                         "the handle is default-constructed and names no tensor: assign it from "
                         "parameter_registry::add or add_state (ctx.registry()) before use");
        return *reg_;
    }

    parameter_registry<T, System>* reg_ = nullptr;
    tensor_kind kind_ = tensor_kind::parameter;
    std::size_t index_ = 0;
};

/// The storage of one replica's parameters: a network declares its trainable tensors
/// (`add`) and state (`add_state`) while it is constructed; finalize() then lays them out in
/// registration order in ONE flat value buffer, ONE flat gradient buffer and ONE flat state
/// buffer (no padding), so the optimizer, the reducers and the broadcasts work on whole
/// buffers with zero copies.
template <class T, class System = host_system>
class parameter_registry {
public:
    using value_type = T;
    using system_type = System;
    using handle = tensor_handle<T, System>;

    explicit parameter_registry(System sys = default_system<System>(), int replica = -1)
        : sys_(std::move(sys)), replica_(replica) {}
    parameter_registry(const parameter_registry&) = delete;
    parameter_registry& operator=(const parameter_registry&) = delete;

    /// Declares a trainable tensor. requires: not finalized, name unique among all tensors,
    /// every extent >= 1. ensures: value() of the handle is zero-filled host staging memory.
    handle add(std::string name, std::vector<std::size_t> shape) {
        return declare(std::move(name), std::move(shape), tensor_kind::parameter);
    }
    handle add(std::string name, std::initializer_list<std::size_t> shape) {
        return add(std::move(name), std::vector<std::size_t>(shape));
    }
    /// Declares a non-trainable state tensor (e.g. BN running mean); same requirements.
    handle add_state(std::string name, std::vector<std::size_t> shape) {
        return declare(std::move(name), std::move(shape), tensor_kind::state);
    }
    handle add_state(std::string name, std::initializer_list<std::size_t> shape) {
        return add_state(std::move(name), std::vector<std::size_t>(shape));
    }

    /// Allocates the flat buffers and copies the staged values in; gradients start at zero.
    /// Idempotent. ensures: finalized(), handles resolve into the flat buffers.
    void finalize() {
        if (finalized_)
            return;
        values_ = buffer<T, System>(count_[0], sys_);
        grads_ = buffer<T, System>(count_[0], sys_);
        state_ = buffer<T, System>(count_[1], sys_);
        for (int k = 0; k < 2; ++k) {
            buffer<T, System>& dst = k == 0 ? values_ : state_;
            for (std::size_t i = 0; i < infos_[k].size(); ++i) {
                const tensor_info& t = infos_[k][i];
                copy(std::span<const T>(staging_[k][i]), host_system{},
                     dst.span().subspan(t.offset, t.size), sys_);
            }
            staging_[k].clear();
        }
        std::vector<T> zeros(count_[0], T(0));
        copy(std::span<const T>(zeros), host_system{}, grads_.span(), sys_);
        finalized_ = true;
    }
    bool finalized() const noexcept { return finalized_; }

    /// The tensor's values (see tensor_handle::value).
    std::span<T> value(const handle& h) {
        const tensor_info& t = info(h);
        const int k = static_cast<int>(h.kind());
        if (!finalized_)
            return std::span<T>(staging_[k][h.index()]);
        return (k == 0 ? values_ : state_).span().subspan(t.offset, t.size);
    }
    /// The parameter's gradient. requires: h is a parameter, finalized().
    std::span<T> grad(const handle& h) {
        const tensor_info& t = info(h);
        LOCKSTEP_REQUIRE(h.kind() == tensor_kind::parameter, errc::invalid_argument, replica_,
                         "parameter_registry.grad", "'", t.name, "' is state, it has no gradient");
        LOCKSTEP_REQUIRE(finalized_, errc::invalid_argument, replica_, "parameter_registry.grad",
                         "gradient of '", t.name, "' requested before finalize()");
        return grads_.span().subspan(t.offset, t.size);
    }
    /// requires (here and in value, grad): h was returned by this registry.
    const tensor_info& info(const handle& h) const {
        LOCKSTEP_REQUIRE(h.belongs_to(*this), errc::invalid_argument, replica_,
                         "parameter_registry",
                         h.valid() ? "the handle names a tensor of another parameter_registry"
                                   : "the handle is default-constructed and names no tensor");
        const auto& v = infos_[static_cast<int>(h.kind())];
        LOCKSTEP_REQUIRE(h.index() < v.size(), errc::invalid_argument, replica_,
                         "parameter_registry", "handle index ", h.index(), " out of range");
        return v[h.index()];
    }

    /// The whole flat buffers. requires: finalized().
    std::span<T> values() { return values_.span(); }
    std::span<T> grads() { return grads_.span(); }
    std::span<T> states() { return state_.span(); }

    /// Trainable tensors in registration order (offsets into values()/grads()).
    const std::vector<tensor_info>& parameters() const noexcept { return infos_[0]; }
    /// State tensors in registration order (offsets into states()).
    const std::vector<tensor_info>& state_tensors() const noexcept { return infos_[1]; }
    /// Total elements of all parameters / of all state.
    std::size_t parameter_count() const noexcept { return count_[0]; }
    std::size_t state_count() const noexcept { return count_[1]; }
    bool empty() const noexcept { return infos_[0].empty() && infos_[1].empty(); }
    /// The handle of a tensor by name, or an invalid handle.
    handle find(std::string_view name) {
        const auto at = by_name_.find(std::string(name));
        return at == by_name_.end() ? handle{} : handle(this, at->second.first, at->second.second);
    }
    const System& system() const noexcept { return sys_; }

private:
    handle declare(std::string name, std::vector<std::size_t> shape, tensor_kind kind) {
        const char* op = kind == tensor_kind::parameter ? "parameter_registry.add"
                                                        : "parameter_registry.add_state";
        LOCKSTEP_REQUIRE(!finalized_, errc::invalid_argument, replica_, op, "'", name,
                         "' declared after finalize(): declare every tensor while the network "
                         "is constructed");
        LOCKSTEP_REQUIRE(!find(name).valid(), errc::invalid_argument, replica_, op, "'", name,
                         "' is declared twice");
        LOCKSTEP_REQUIRE(!shape.empty() &&
                             std::find(shape.begin(), shape.end(), std::size_t(0)) == shape.end(),
                         errc::invalid_argument, replica_, op, "'", name, "' has shape ",
                         shape_string(shape), ": every extent must be >= 1");
        // Overflow-checked: {2^63 + 1, 2} must not pass as 2 elements.
        const std::size_t n = checked_product(shape, replica_, op, "'" + name + "'");
        const int k = static_cast<int>(kind);
        (void)checked_bytes(checked_add(count_[k], n, replica_, op,
                                        "elements of '" + name + "' plus those declared before"),
                            sizeof(T), replica_, op, "the flat buffer with '" + name + "'");
        infos_[k].push_back(tensor_info{std::move(name), std::move(shape), count_[k], n, kind});
        staging_[k].emplace_back(n, T(0));
        count_[k] += n;
        by_name_.emplace(infos_[k].back().name, std::pair{kind, infos_[k].size() - 1});
        return handle(this, kind, infos_[k].size() - 1);
    }

    System sys_;
    int replica_ = -1;
    bool finalized_ = false;
    std::vector<tensor_info> infos_[2];
    std::vector<std::vector<T>> staging_[2];
    std::size_t count_[2] = {0, 0};
    // Every name's kind and index: find() (and so every add's duplicate check) in constant time,
    // not a scan of the tensors declared before (quadratic construction for many tensors).
    std::unordered_map<std::string, std::pair<tensor_kind, std::size_t>> by_name_;
    buffer<T, System> values_, grads_, state_;
};

} // namespace lockstep
