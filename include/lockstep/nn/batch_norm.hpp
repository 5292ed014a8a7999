// lockstep/nn/batch_norm.hpp: nn::batch_norm<T, BNStatPolicy, Layout, System>, batch
// normalization whose cross-replica statistics are a compile-time policy.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/communicator.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/core/span_overlap.hpp"
#include "lockstep/kernels/bn_forward.hpp"
#include "lockstep/kernels/bn_statistics.hpp"
#include "lockstep/kernels/moments.hpp"
#include "lockstep/nn/batch_norm_params.hpp"
#include "lockstep/nn/detail/bn_state.hpp"
#include "lockstep/nn/detail/bn_status.hpp"
#include "lockstep/nn/detail/bn_training.hpp"
#include "lockstep/nn/layer_step.hpp"
#include "lockstep/nn/layout.hpp"
#include "lockstep/policy/bn.hpp"
#include "lockstep/system/host_system.hpp"

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>
#include <utility>

namespace lockstep::nn {

/// Batch normalization over the channels of a (N, C, ...) tensor in Layout, on System, with
/// the cross-replica statistics of Policy (see policy/bn.hpp).
///
/// - gamma and beta (type param_type: float for float, half and bfloat16 data, double for
///   double) are ordinary trainable parameters; backward ADDS this replica's partial gradients
///   to dgamma and dbeta. The trainer sums them across replicas like every other gradient;
///   under bn::global the sum equals the single-device gradient of the global batch, and dx
///   needs no further reduction (it already is the single-device dx).
/// - running_mean and running_var are state (checkpoints carry them once the network exposes
///   them through for_each_state or the registry; num_batches_tracked, a host count, only if
///   exposed likewise): running = (1 - momentum) * running + momentum * batch, with the
///   unbiased variance over the count that produced it: the global count under bn::global and
///   bn::running_only, the group count under bn::group, replica K's count under bn::tower<K>,
///   the local count under bn::local. A batch of zero values leaves them unchanged
///   (num_batches_tracked still counts).
///   bn::ghost<C> inside a reduce::reproducible step: each call (one chunk) is normalized with its
///   own statistics and leaves the running statistics alone; at the end of the step every
///   replica's chunk statistics are gathered (one all_gather) and applied in global chunk order,
///   each with its own count, and num_batches_tracked grows by the step's chunk count: the same
///   bits on every replica for every replica count. Outside such a step it acts as bn::local.
///   num_batches_tracked is a host count: a data_parallel step captured into a CUDA graph adds
///   nothing, each launch counted by data_parallel::count_replay adds what one plain step adds.
/// - Every replica calls forward_train and backward of a communicating policy the same number
///   of times in the same order (an empty shard takes part with count 0).
/// - A layer belongs to one replica (the one whose communicator built it, else the first to
///   train it): a call from another replica's thread and rank is refused (invalid_argument)
///   before it touches the layer; make one layer per replica, inside the replica's function.
/// - Stream contract: every kernel of the layer runs on its system (on CUDA: one device, one
///   stream), which must be the communicator's: construct the layer from the communicator
///   (`batch_norm(comm, channels)`) or pass comm.system(). A layer used with a communicator of
///   another device or stream is rejected with lockstep::error (invalid_argument) before any
///   work is enqueued. Its collectives run on that same stream, so statistics are ordered
///   between the kernels that write and read them without any host synchronisation.
/// - Errors. Invalid input on this replica (shape, channels, sizes) is found on the host and
///   thrown on this replica; under a communicating policy the replica first takes part in the
///   collective with an invalid-input status, so its peers learn of it. Errors that depend on
///   the other replicas (a peer's invalid input, statistics over one value per channel) are
///   found on the device. During a data_parallel step they go into the step's status (the step
///   is skipped on every replica and the trainer throws at the end of the step, or when its
///   result is read); outside a step the layer reads its status back at once (one host
///   synchronisation, through the communicator's polling wait) and throws on every replica
///   that shares the collective (bn::local: on the bad replica only).
/// - Every replica builds its own layer; the replicas that train it with a policy that shares
///   statistics (bn::ghost: a reproducible step's replicas) must build it with the same
///   policy, channels, eps, momentum and affine. Once per layer, before its first statistics
///   collective (bn::ghost: before its first step-end gather), one all_reduce of these values
///   over the layer's communicator (bn::group: every group) and one host wait compare them
///   exactly (detail::settings_agreement); a difference throws lockstep::error
///   (invalid_argument) on every replica, naming the layer, each differing setting with this
///   replica's value and the range, and the fix. bn::local layers share nothing and are not
///   compared.
/// - Per training step, forward + backward of a communicating layer enqueue 5 passes (packed
///   statistics, merge + coefficients, normalize; packed backward sums, dx; on CUDA 4, the
///   merge inside the normalize launch) and 2 collectives
///   (bn::global, bn::group; the others 1 or none), and never wait on the host inside a step
///   (but for the settings check above, at the layer's first training call).
/// - Its training passes and the state they keep are its base's, detail::bn_training.
template <class T, bn_stat_policy Policy = bn::local, tensor_layout Layout = nchw,
          class System = host_system>
class batch_norm final : private detail::bn_training<T, Policy, Layout, System> {
    static_assert(!System::is_host || std::is_same_v<T, float> || std::is_same_v<T, double>,
                  "nn::batch_norm on the host system takes float or double data; half and "
                  "bfloat16 storage is available on the CUDA system only.");

public:
    using value_type = T;
    using param_type = kernels::accumulation_t<T>;
    using policy_type = Policy;
    using layout_type = Layout;
    using system_type = System;
    using params = batch_norm_params;

    /// Views of caller-owned parameter storage of `channels` values each, in sys's memory, and
    /// what the layer does with the values gamma and beta already hold (`values`).
    using parameter_spans = batch_norm_spans<param_type>;

    /// A layer that owns its parameters, on the host system (with the machine's thread budget:
    /// prefer the communicator constructor in replicas). requires: channels >= 1, finite eps at
    /// least std::numeric_limits<param_type>::min(), 0 <= momentum <= 1.
    /// ensures: gamma = 1, beta = 0, dgamma = dbeta = 0, running_mean = 0, running_var = 1.
    explicit batch_norm(std::size_t channels, params p = {}) requires System::is_host
        : batch_norm(channels, parameter_spans{}, p, System{}, true) {}
    /// As above, on the system sys (e.g. comm.system()).
    batch_norm(std::size_t channels, params p, System sys)
        : batch_norm(channels, parameter_spans{}, p, std::move(sys), true) {}
    /// As above, on the communicator's system: the layer's kernels share its device and stream.
    template <communicator Comm>
    requires std::is_same_v<typename Comm::system_type, System>
    batch_norm(const Comm& comm, std::size_t channels, params p = {})
        : batch_norm(channels, parameter_spans{}, p, comm.system(), true, comm.rank()) {}

    /// As above on an explicit system, checked against the communicator's at construction:
    /// a system of another device or stream is refused with lockstep::error (invalid_argument)
    /// naming both.
    template <communicator Comm>
    requires std::is_same_v<typename Comm::system_type, System>
    batch_norm(const Comm& comm, std::size_t channels, params p, System sys)
        : batch_norm(channels, parameter_spans{}, p, std::move(sys), true, comm.rank()) {
        detail::check_system(s_.sys, comm, "batch_norm");
    }

    /// A layer whose gamma, beta, dgamma and dbeta live in caller-provided spans (e.g. the
    /// replica's parameter registry); they must outlive the layer. requires: p.affine and every
    /// span holds `channels` values; with external.values == initial_values::fresh (the
    /// default), gamma and beta hold only zeros (else lockstep::error, invalid_argument: values
    /// set by the caller are not silently overwritten). ensures: dgamma = dbeta = 0, running
    /// statistics reset; gamma = 1, beta = 0 (fresh, reset) or unchanged (keep).
    batch_norm(std::size_t channels, parameter_spans external,
               params p = {}) requires System::is_host
        : batch_norm(channels, external, p, System{}, false) {}
    batch_norm(std::size_t channels, parameter_spans external, params p, System sys)
        : batch_norm(channels, external, p, std::move(sys), false) {}
    template <communicator Comm>
    requires std::is_same_v<typename Comm::system_type, System>
    batch_norm(const Comm& comm, std::size_t channels, parameter_spans external, params p = {})
        : batch_norm(channels, external, p, comm.system(), false, comm.rank()) {}

    std::size_t channels() const noexcept { return s_.channels; }
    const params& options() const noexcept { return p_; }
    const System& system() const noexcept { return s_.sys; }

    /// Trainable parameters and their gradients (empty when !options().affine).
    std::span<param_type> gamma() noexcept {
        return p_.affine ? s_.gamma : std::span<param_type>{};
    }
    std::span<param_type> beta() noexcept { return p_.affine ? s_.beta : std::span<param_type>{}; }
    std::span<param_type> dgamma() noexcept { return s_.dgamma; }
    std::span<param_type> dbeta() noexcept { return s_.dbeta; }
    /// State: the running statistics (writable, so a checkpoint can restore them).
    std::span<param_type> running_mean() noexcept { return s_.running_mean(); }
    std::span<param_type> running_var() noexcept { return s_.running_var(); }
    std::int64_t num_batches_tracked() const noexcept { return batches_; }
    void set_num_batches_tracked(std::int64_t n) noexcept { batches_ = n; }
    /// ensures: running_mean = 0, running_var = 1, num_batches_tracked = 0.
    void reset_running_stats() {
        detail::fill(s_.sys, s_.running_mean(), param_type(0));
        detail::fill(s_.sys, s_.running_var(), param_type(1));
        batches_ = 0;
    }
    /// The mean and 1/sqrt(var + eps) the last forward_train normalized with.
    std::span<const param_type> batch_mean() { return s_.batch_mean(); }
    std::span<const param_type> batch_invstd() { return s_.batch_invstd(); }

    /// Training forward: y = (x - mean) / sqrt(var + eps) * gamma + beta with the batch
    /// statistics Policy selects; updates the running statistics. x must stay valid and
    /// unchanged until backward (it is read again there). Calls traits::forward_collectives
    /// collectives on comm (bn::group splits comm once more on first use).
    /// requires: comm.system() is the layer's system; shape in Layout order ({N, C, H, W},
    /// {N, H, W, C} or {N, C}) with C == channels(); x.size() == y.size() == shape.elements();
    /// the statistics are taken over more than one value per channel (globally under
    /// bn::global) unless over none.
    /// Outside a trainer's step (no layer_step): the layer checks its own status at once and
    /// throws what it found (y is then written, its values unspecified).
    /// Inside a trainer's step function this form is refused on every replica
    /// (lockstep::error, invalid_argument, before any work): there the context form below is
    /// the one that keeps the running statistics with the step's skip decision and bn::ghost
    /// with the step's chunks.
    template <communicator Comm>
    void forward_train(Comm& comm, std::span<const T> x, const tensor_shape& shape,
                       std::span<T> y) {
        refuse_inside_step(comm, "forward_train", "forward_train(ctx, x, shape, y)");
        train_forward(comm, nullptr, nullptr, x, shape, y);
    }
    /// Inside a trainer's step, with the replica_context the step function got: as above on
    /// ctx.comm(), and the layer's device-side errors go to the step (reported at its end, the
    /// step skipped on every replica), the running statistics are restored when the step is
    /// skipped, and bn::ghost follows the reproducible step's chunks.
    template <layer_context Ctx>
    requires(!communicator<Ctx>) void forward_train(Ctx& ctx, std::span<const T> x,
                                                    const tensor_shape& shape, std::span<T> y) {
        train_forward(ctx.comm(), ctx.layer_step(), ctx.policies(), x, shape, y);
    }

    /// Inference forward with the running statistics; no communication.
    /// requires: as forward_train (any number of values per channel).
    void forward_eval(std::span<const T> x, const tensor_shape& shape, std::span<T> y) {
        const std::string problem =
            detail::check_input<Layout>(s_.channels, x.size(), shape, y.size());
        if (!problem.empty())
            fail(errc::shape_mismatch, -1, "batch_norm.forward_eval", problem);
        const std::string overlap = lockstep::detail::overlap_problem(x, "x", y, "y");
        if (!overlap.empty())
            fail(errc::invalid_argument, -1, "batch_norm.forward_eval", overlap);
        kernels::finish_and_normalize(
            s_.sys,
            kernels::eval_coefficients_fn<param_type>{
                s_.running_mean().data(), s_.running_var().data(), s_.gamma.data(),
                static_cast<param_type>(p_.eps), s_.eval_mean().data(), s_.eval_scale().data()},
            x, y, Layout::geometry(shape), std::span<const param_type>(s_.beta));
    }

    /// Backward of the last forward_train, once (a second backward without a new forward_train
    /// is refused, invalid_argument: one layer object per use): writes dx, adds this replica's
    /// partial sums to dgamma and dbeta. Under bn::global and bn::group one all_reduce of
    /// (sum dy, sum dy * (x - mean)) makes dx the gradient of the combined batch. requires:
    /// dy.size() == dx.size() == the size of the last forward_train's x, which is still valid.
    /// Outside a trainer's step (a communicator): a peer's invalid gradients are checked at once
    /// (one host wait).
    template <communicator Comm>
    void backward(Comm& comm, std::span<const T> dy, std::span<T> dx) {
        refuse_inside_step(comm, "backward", "backward(ctx, dy, dx)");
        train_backward(comm, nullptr, nullptr, dy, dx);
    }
    /// Inside a trainer's step (its replica_context): nothing waits on the host.
    template <layer_context Ctx>
    requires(!communicator<Ctx>) void backward(Ctx& ctx, std::span<const T> dy, std::span<T> dx) {
        train_backward(ctx.comm(), ctx.layer_step(), ctx.policies(), dy, dx);
    }

private:
    using base = detail::bn_training<T, Policy, Layout, System>;
    using base::batches_;
    using base::p_;
    using base::refuse_inside_step;
    using base::s_;
    using base::train_backward;
    using base::train_forward;

    batch_norm(std::size_t channels, parameter_spans ext, params p, System sys, bool owning,
               int rank = -1)
        : base(channels, ext, p, std::move(sys), owning, rank) {
        reset_running_stats();
    }
};

} // namespace lockstep::nn
