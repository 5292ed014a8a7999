// examples/digits/digits_async.cpp: the parameter-server runs of the digits demo
// (sync::asynchronous, sync::bounded_staleness<S> for S = 1, 4). SPDX-License-Identifier:
// Apache-2.0
#include "digits_comm.hpp"
#include "digits_run.hpp"

namespace digits {
namespace {
// Mirrors lockstep's compile-time rules (policy/compat.hpp) so the demo can say why. The
// server receives whole gradients point to point, so the reduce policy plays no part: only the
// default is compiled.
struct async_valid {
    template <class R, class B>
    auto operator()(std::type_identity<R>, std::type_identity<B>) const {
        return std::bool_constant < std::is_same_v<B, lockstep::bn::local> && std::is_same_v < R,
               lockstep::reduce::bucketed < >>> {};
    }
    template <class R, class B>
    std::string reason(std::type_identity<R>, std::type_identity<B>) const {
        if (!std::is_same_v<B, lockstep::bn::local> && !lockstep::bn::is_ghost<B>)
            return "asynchronous workers run forward at their own pace, so BN statistics cannot "
                   "be shared across replicas inside a step: use --bn local (the server keeps "
                   "the running statistics)";
        if (R::update_root >= 0)
            return "sync::asynchronous already is a parameter server; reduce::parameter_server "
                   "is its synchronous form: drop --reduce ps";
        if (std::string w = reproducible_reason<lockstep::sync::asynchronous, R, B>(); !w.empty())
            return w;
        return "the asynchronous server receives whole gradients point to point: --reduce does "
               "not apply (leave it at bucketed)";
    }
};
} // namespace

template <class Comm>
bool run_asynchronous(Comm& comm, const options& o, const split_data& d, result& r,
                      std::string& why) {
    namespace sync = lockstep::sync;
    if (o.sync == "async")
        return dispatch_all_bn<sync::asynchronous>(comm, o, d, r, why, async_valid{});
    const std::string s = o.sync.substr(6); // "stale:S"
    if (s == "1")
        return dispatch_all_bn<sync::bounded_staleness<1>>(comm, o, d, r, why, async_valid{});
    if (s == "4")
        return dispatch_all_bn<sync::bounded_staleness<4>>(comm, o, d, r, why, async_valid{});
    why = "--sync stale:S is compiled for S = 1 and 4 (got " + s + ")";
    return false;
}

template bool run_asynchronous(DIGITS_COMMUNICATOR&, const options&, const split_data&, result&,
                               std::string&);

} // namespace digits
