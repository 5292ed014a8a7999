// lockstep/train/detail/agreement.hpp: the settings every replica of a trainer must share
// (optimizer type and hyperparameters, micro-batches, policies), described as "name<TAB>value"
// lines that the construction-time signature check compares across replicas.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/train/train_params.hpp"

#include <algorithm>
#include <charconv>
#include <cstdlib>
#include <memory>
#include <string>
#include <typeinfo>
#include <vector>

#if defined(__GNUC__) || defined(__clang__)
#include <cxxabi.h>
#endif

namespace lockstep::detail {

/// A readable name of type T (demangled where the compiler offers it).
template <class T>
std::string type_name() {
    const char* raw = typeid(T).name();
#if defined(__GNUC__) || defined(__clang__)
    int status = 0;
    std::unique_ptr<char, void (*)(void*)> d(abi::__cxa_demangle(raw, nullptr, nullptr, &status),
                                             std::free);
    if (status == 0 && d)
        return d.get();
#endif
    return raw;
}

/// A double as the shortest text that reads back to the same value (e.g. "0.1").
inline std::string exact(double v) {
    char buf[64];
    const auto res = std::to_chars(buf, buf + sizeof buf, v);
    return std::string(buf, res.ptr);
}

/// Appends "name<TAB>value".
inline void add_setting(std::vector<std::string>& out, const std::string& name,
                        const std::string& value) {
    out.push_back(name + "\t" + value);
}

/// "{a,b}": `names` sorted, comma-separated, in braces.
inline std::string name_set(std::vector<std::string> names) {
    std::sort(names.begin(), names.end());
    std::string out;
    for (const std::string& n : names)
        out += (out.empty() ? "" : ",") + n;
    return "{" + out + "}";
}

/// The hyperparameters of an optimizer's params struct that lockstep's optimizers have (any
/// params type: the fields it lacks are left out).
template <class P>
void describe_optimizer_params(std::vector<std::string>& out, const P& p) {
    if constexpr (requires { p.lr; })
        add_setting(out, "lr", exact(p.lr));
    if constexpr (requires { p.momentum; })
        add_setting(out, "momentum", exact(p.momentum));
    if constexpr (requires { p.dampening; })
        add_setting(out, "dampening", exact(p.dampening));
    if constexpr (requires { p.nesterov; })
        add_setting(out, "nesterov", p.nesterov ? "true" : "false");
    if constexpr (requires { p.beta1; })
        add_setting(out, "beta1", exact(p.beta1));
    if constexpr (requires { p.beta2; })
        add_setting(out, "beta2", exact(p.beta2));
    if constexpr (requires { p.eps; })
        add_setting(out, "eps", exact(p.eps));
    if constexpr (requires { p.eta; })
        add_setting(out, "eta", exact(p.eta));
    if constexpr (requires { p.weight_decay; })
        add_setting(out, "weight_decay", exact(p.weight_decay));
    if constexpr (requires { p.phi_min; })
        add_setting(out, "phi_min", exact(p.phi_min));
    if constexpr (requires { p.phi_max; })
        add_setting(out, "phi_max", exact(p.phi_max));
}

/// The settings of a trainer that must agree across replicas: the optimizer type and its
/// hyperparameters, seed (ctx.rng draws are keyed by the global sample: a seed per replica would
/// make a sample's randomness depend on the replica holding it), micro_batches, overlap,
/// skip_non_finite, max_consecutive_skips, max_grad_norm, loss_scale (off, or each of its
/// fields), read_result (a replica that reads a step's error throws while one that does not goes
/// on), verify_every, report_stragglers_every, on_replica_failure, min_replicas, which
/// tensors are frozen or decay (sets of names), and the given policy names (sync, reduce, BN).
template <class Optimizer>
std::vector<std::string> describe_settings(const typename Optimizer::params_type& opt,
                                           const train_params& tp,
                                           const std::vector<tensor_info>& params,
                                           const std::vector<std::string>& policies) {
    std::vector<std::string> out;
    add_setting(out, "optimizer", type_name<Optimizer>());
    describe_optimizer_params(out, opt);
    add_setting(out, "seed", std::to_string(tp.seed));
    add_setting(out, "micro_batches", std::to_string(tp.micro_batches));
    add_setting(out, "overlap", std::to_string(static_cast<int>(tp.overlap)));
    add_setting(out, "skip_non_finite", tp.skip_non_finite ? "true" : "false");
    add_setting(out, "max_consecutive_skips", std::to_string(tp.max_consecutive_skips));
    add_setting(out, "max_grad_norm", exact(tp.max_grad_norm));
    if (const auto& ls = tp.loss_scale)
        add_setting(out, "loss_scale",
                    "init_scale=" + exact(ls->init_scale) + " growth_factor=" +
                        exact(ls->growth_factor) + " backoff_factor=" + exact(ls->backoff_factor) +
                        " growth_interval=" + std::to_string(ls->growth_interval) +
                        " min_scale=" + exact(ls->min_scale));
    else
        add_setting(out, "loss_scale", "off");
    add_setting(out, "read_result", tp.read_result ? "true" : "false");
    add_setting(out, "verify_every", std::to_string(tp.verify_every));
    add_setting(out, "report_stragglers_every", std::to_string(tp.report_stragglers_every));
    add_setting(out, "on_replica_failure",
                tp.on_replica_failure == replica_failure::shrink ? "shrink" : "stop");
    add_setting(out, "min_replicas", std::to_string(tp.min_replicas));
    // As sets of names, sorted: replicas that declare their tensors in different orders are
    // told so by the tensor check, and do not disagree on these too.
    std::vector<std::string> frozen, decay;
    for (const tensor_info& t : params) {
        if (tp.frozen && tp.frozen(t))
            frozen.push_back(t.name);
        if (!tp.decay || tp.decay(t))
            decay.push_back(t.name);
    }
    add_setting(out, "frozen", name_set(frozen));
    add_setting(out, "decay", name_set(decay));
    for (const std::string& p : policies)
        out.push_back(p);
    return out;
}

} // namespace lockstep::detail
