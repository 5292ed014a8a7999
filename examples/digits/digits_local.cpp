// examples/digits/digits_local.cpp: the sync::local_sgd<K> runs of the digits demo (K = 4, 16).
// SPDX-License-Identifier: Apache-2.0
#include "digits_comm.hpp"
#include "digits_run.hpp"

namespace digits {
namespace {
// Mirrors lockstep's compile-time rules (policy/compat.hpp) so the demo can say why.
struct local_sgd_valid {
    template <class R, class B>
    auto operator()(std::type_identity<R>, std::type_identity<B>) const {
        return std::bool_constant < !lockstep::bn::needs_synchronous<B> && !R::rounds_on_wire &&
               reproducible_valid<lockstep::sync::local_sgd<4>, R, B> > {};
    }
    template <class R, class B>
    std::string reason(std::type_identity<R>, std::type_identity<B>) const {
        if (lockstep::bn::needs_synchronous<B>)
            return "bn::global and bn::group normalize across replicas inside every step, so "
                   "they need sync::synchronous; with local SGD use --bn local, running_only or "
                   "tower0";
        if (R::rounds_on_wire)
            return "local SGD averages weights, and reduce::compressed would round them to 16 "
                   "bits: use --reduce per_tensor, bucketed or ps";
        return reproducible_reason<lockstep::sync::local_sgd<4>, R, B>();
    }
};
} // namespace

template <class Comm>
bool run_local_sgd(Comm& comm, const options& o, const split_data& d, result& r, std::string& why) {
    namespace sync = lockstep::sync;
    const std::string k = o.sync.substr(6); // "local:K"
    if (k == "4")
        return dispatch_all_bn<sync::local_sgd<4>>(comm, o, d, r, why, local_sgd_valid{});
    if (k == "16")
        return dispatch_all_bn<sync::local_sgd<16>>(comm, o, d, r, why, local_sgd_valid{});
    why = "--sync local:K is compiled for K = 4 and 16 (got " + k + ")";
    return false;
}

template bool run_local_sgd(DIGITS_COMMUNICATOR&, const options&, const split_data&, result&,
                            std::string&);

} // namespace digits
