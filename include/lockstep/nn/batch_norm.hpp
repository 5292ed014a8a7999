// lockstep/nn/batch_norm.hpp: nn::batch_norm<T, BNStatPolicy, Layout, System>, batch
// normalization whose cross-replica statistics are a compile-time policy.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/communicator.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/kernels/bn_backward.hpp"
#include "lockstep/kernels/bn_forward.hpp"
#include "lockstep/kernels/bn_functors.hpp"
#include "lockstep/kernels/moments.hpp"
#include "lockstep/nn/detail/bn_state.hpp"
#include "lockstep/nn/layout.hpp"
#include "lockstep/policy/bn.hpp"
#include "lockstep/system/host_system.hpp"

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <typeinfo>
#include <vector>

namespace lockstep::nn {

/// Runtime options of a batch-norm layer.
struct batch_norm_params {
    double eps = 1e-5;     ///< added to the variance before the square root
    double momentum = 0.1; ///< running = (1 - momentum) * running + momentum * batch
    bool affine = true;    ///< learn gamma and beta (else y = xhat)
};

/// Batch normalization over the channels of a (N, C, ...) tensor in Layout, on System, with
/// the cross-replica statistics of Policy (see policy/bn.hpp).
///
/// - gamma and beta (type param_type: float for float, half and bfloat16 data, double for
///   double) are ordinary trainable parameters; backward ADDS this replica's partial gradients
///   to dgamma and dbeta. The trainer sums them across replicas like every other gradient;
///   under bn::global the sum equals the single-device gradient of the global batch, and dx
///   needs no further reduction (it already is the single-device dx).
/// - running_mean, running_var and num_batches_tracked are state (checkpoints carry them):
///   running = (1 - momentum) * running + momentum * batch, with the unbiased variance over the
///   count that produced it: the global count under bn::global and bn::running_only, the group
///   count under bn::group, replica K's count under bn::tower<K>, the local count under
///   bn::local. A batch of zero values leaves them unchanged (num_batches_tracked still counts).
/// - Every replica calls forward_train and backward of a communicating policy the same number
///   of times in the same order (an empty shard takes part with count 0). Bad input on one
///   replica is reported as lockstep::error on every replica that shares the collective.
///   (bn::group: the replicas of the group; bn::local raises it on the bad replica only.)
/// - Pass the replica's system (comm.system()) so the layer's kernels respect its thread
///   budget. On the CUDA system, a communicating forward reads the gathered statistics block
///   back to the host once (and bn::global/group backward one status value), a stream
///   synchronisation that buys the consistent errors above.
template <class T, bn_stat_policy Policy = bn::local, tensor_layout Layout = nchw,
          class System = host_system>
class batch_norm {
    static_assert(!System::is_host || std::is_same_v<T, float> || std::is_same_v<T, double>,
                  "nn::batch_norm on the host system takes float or double data; half and "
                  "bfloat16 storage is available on the CUDA system only.");
    using traits = bn::traits<Policy>;

public:
    using value_type = T;
    using param_type = kernels::accumulation_t<T>;
    using policy_type = Policy;
    using layout_type = Layout;
    using system_type = System;
    using params = batch_norm_params;

    /// Views of caller-owned parameter storage of `channels` values each, in sys's memory.
    struct parameter_spans {
        std::span<param_type> gamma, beta, dgamma, dbeta;
    };

    /// A layer that owns its parameters. requires: channels >= 1, eps > 0, 0 <= momentum <= 1.
    /// ensures: gamma = 1, beta = 0, dgamma = dbeta = 0, running_mean = 0, running_var = 1.
    explicit batch_norm(std::size_t channels, params p = {}, System sys = System{})
        : batch_norm(channels, parameter_spans{}, p, std::move(sys), true) {}

    /// A layer whose gamma, beta, dgamma and dbeta live in caller-provided spans (e.g. the
    /// replica's parameter registry); they must outlive the layer. requires: p.affine and every
    /// span holds `channels` values. ensures: as the owning constructor, in those spans.
    batch_norm(std::size_t channels, parameter_spans external, params p = {}, System sys = System{})
        : batch_norm(channels, external, p, std::move(sys), false) {}

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
    std::span<const param_type> batch_mean() { return s_.coefficient(0); }
    std::span<const param_type> batch_invstd() { return s_.coefficient(1); }

    /// Training forward: y = (x - mean) / sqrt(var + eps) * gamma + beta with the batch
    /// statistics Policy selects; updates the running statistics. x must stay valid and
    /// unchanged until backward (it is read again there). Calls traits::forward_collectives
    /// collectives on comm (bn::group splits comm once more on first use).
    /// requires: shape in Layout order ({N, C, H, W}, {N, H, W, C} or {N, C}) with C ==
    /// channels(); x.size() == y.size() == shape.elements(); the statistics are taken over more
    /// than one value per channel (globally under bn::global) unless over none.
    template <communicator Comm>
    void forward_train(Comm& comm, std::span<const T> x, const tensor_shape& shape,
                       std::span<T> y) {
        static constexpr const char* op = "batch_norm.forward_train";
        const int rank = comm.rank();
        const std::string problem = check_input(x.size(), shape, y.size());
        has_forward_ = false;
        if constexpr (!bn::communicates<Policy>) {
            if (!problem.empty())
                fail(errc::shape_mismatch, rank, op, problem);
        }
        if constexpr (is_tower) {
            LOCKSTEP_REQUIRE(Policy::replica < comm.size(), errc::invalid_argument, rank, op,
                             "bn::tower<", Policy::replica, "> needs more than ", Policy::replica,
                             " replicas, the communicator has ", comm.size());
        }
        const kernels::channel_geometry g =
            problem.empty() ? Layout::geometry(shape) : kernels::channel_geometry{};
        const auto count = static_cast<param_type>(g.per_channel());
        if (problem.empty()) {
            auto ws =
                detail::ensure(s_.moments_workspace, kernels::moments_workspace_size(g), s_.sys);
            kernels::channel_moments(s_.sys, x, g, s_.local.span(), ws);
        } else {
            detail::fill(s_.sys, s_.local.span(), kernels::moments<param_type>{});
        }
        const kernels::moments<param_type>* norm = s_.local.data();
        const kernels::moments<param_type>* running = s_.local.data();
        param_type norm_count = count;
        if constexpr (bn::communicates<Policy>) {
            auto& sc = statistics_communicator(comm);
            const std::vector<param_type> counts =
                exchange_moments(sc, problem.empty() ? 0 : 1, count);
            if (!problem.empty())
                fail(errc::shape_mismatch, rank, op, problem);
            const int replicas = static_cast<int>(counts.size());
            for (int r = 0; r < replicas; ++r)
                LOCKSTEP_REQUIRE(counts[r] >= 0, errc::peer_failure, rank, op, "replica ",
                                 world_rank(rank, r), " passed invalid input to this layer");
            if constexpr (traits::normalizes_across_replicas) {
                norm_count = 0;
                for (int r = 0; r < replicas; ++r)
                    norm_count += counts[r];
                LOCKSTEP_REQUIRE(norm_count != 1, errc::invalid_argument, rank, op,
                                 "expected more than 1 value per channel when training, got 1 "
                                 "over ",
                                 replicas, " replicas (", shape, " here)");
            } else {
                for (int r = 0; r < replicas; ++r)
                    LOCKSTEP_REQUIRE(counts[r] != 1, errc::invalid_argument, rank, op,
                                     "expected more than 1 value per channel when training, "
                                     "replica ",
                                     r, " has 1");
            }
            const int first = is_tower ? tower_replica() : 0;
            const int last = is_tower ? tower_replica() + 1 : replicas;
            kernels::detail::for_each_index(
                s_.sys, s_.channels,
                kernels::merge_replicas_fn<param_type>{s_.gathered.data(), 2 + 2 * s_.channels,
                                                       first, last, s_.merged.data()});
            running = s_.merged.data();
            if constexpr (traits::normalizes_across_replicas)
                norm = s_.merged.data();
        } else {
            LOCKSTEP_REQUIRE(count != 1, errc::invalid_argument, rank, op,
                             "expected more than 1 value per channel when training, got input ",
                             shape);
        }
        kernels::detail::for_each_index(
            s_.sys, s_.channels,
            kernels::train_coefficients_fn<param_type>{
                norm, running, s_.gamma.data(), static_cast<param_type>(p_.eps),
                static_cast<param_type>(p_.momentum), s_.coefficient(0).data(),
                s_.coefficient(1).data(), s_.coefficient(2).data(), s_.running_mean().data(),
                s_.running_var().data()});
        ++batches_;
        kernels::normalize(s_.sys, x, y, g, const_span(s_.coefficient(0)),
                           const_span(s_.coefficient(2)), const_span(s_.beta));
        saved_x_ = x;
        saved_geometry_ = g;
        saved_count_ = norm_count;
        has_forward_ = true;
    }

    /// Inference forward with the running statistics; no communication.
    /// requires: as forward_train (any number of values per channel).
    void forward_eval(std::span<const T> x, const tensor_shape& shape, std::span<T> y) {
        const std::string problem = check_input(x.size(), shape, y.size());
        if (!problem.empty())
            fail(errc::shape_mismatch, -1, "batch_norm.forward_eval", problem);
        kernels::detail::for_each_index(s_.sys, s_.channels,
                                        kernels::eval_coefficients_fn<param_type>{
                                            s_.running_mean().data(), s_.running_var().data(),
                                            s_.gamma.data(), static_cast<param_type>(p_.eps),
                                            s_.coefficient(3).data(), s_.coefficient(4).data()});
        kernels::normalize(s_.sys, x, y, Layout::geometry(shape), const_span(s_.coefficient(3)),
                           const_span(s_.coefficient(4)), const_span(s_.beta));
    }

    /// Backward of the last forward_train: writes dx, adds this replica's partial sums to dgamma
    /// and dbeta. Under bn::global and bn::group one all_reduce of (sum dy, sum dy * (x - mean))
    /// makes dx the gradient of the combined batch. requires: dy.size() == dx.size() == the
    /// size of the last forward_train's x, which is still valid.
    template <communicator Comm>
    void backward(Comm& comm, std::span<const T> dy, std::span<T> dx) {
        static constexpr const char* op = "batch_norm.backward";
        const int rank = comm.rank();
        std::string problem;
        if (!has_forward_)
            problem = "backward needs a preceding forward_train on this replica";
        else if (dy.size() != saved_x_.size() || dx.size() != saved_x_.size())
            problem = lockstep::detail::concat("dy has ", dy.size(), " values and dx ", dx.size(),
                                               ", the forward input had ", saved_x_.size());
        if constexpr (!traits::normalizes_across_replicas) {
            if (!problem.empty())
                fail(errc::shape_mismatch, rank, op, problem);
        }
        const std::size_t C = s_.channels;
        std::span<param_type> local = s_.sums.span().first(2 * C + 1);
        std::span<param_type> combined = s_.sums.span().subspan(2 * C + 1, 2 * C + 1);
        const kernels::channel_geometry g =
            problem.empty() ? saved_geometry_ : kernels::channel_geometry{};
        if (problem.empty()) {
            auto ws =
                detail::ensure(s_.backward_workspace, kernels::backward_workspace_size(g), s_.sys);
            kernels::backward_sums(s_.sys, dy, saved_x_, g, const_span(s_.coefficient(0)),
                                   local.first(2 * C), ws);
        } else {
            detail::fill(s_.sys, local.first(2 * C), param_type(0));
        }
        detail::fill(s_.sys, local.last(1), param_type(problem.empty() ? 0 : 1));
        const param_type* totals = local.data();
        if constexpr (traits::normalizes_across_replicas) {
            auto& sc = statistics_communicator(comm);
            sc.all_reduce(std::span<const param_type>(local), combined, reduce_op::sum);
            if (!problem.empty())
                fail(errc::shape_mismatch, rank, op, problem);
            const param_type failed =
                detail::to_host(s_.sys, std::span<const param_type>(combined.last(1)))[0];
            LOCKSTEP_REQUIRE(failed == 0, errc::peer_failure, rank, op, failed,
                             " other replica(s) passed invalid gradients to this layer");
            totals = combined.data();
        }
        kernels::detail::for_each_index(
            s_.sys, C,
            kernels::backward_coefficients_fn<param_type>{
                totals, local.data(), C, saved_count_, s_.gamma.data(), s_.coefficient(1).data(),
                s_.coefficient(3).data(), s_.coefficient(4).data(), s_.coefficient(5).data(),
                p_.affine ? s_.dgamma.data() : nullptr, p_.affine ? s_.dbeta.data() : nullptr});
        kernels::input_gradient(s_.sys, dy, saved_x_, dx, g,
                                kernels::backward_coefficients<param_type>{
                                    s_.coefficient(0).data(), s_.coefficient(3).data(),
                                    s_.coefficient(4).data(), s_.coefficient(5).data()});
    }

private:
    static constexpr bool is_tower = requires { Policy::replica; };
    static constexpr bool is_group = requires { Policy::size; };

    batch_norm(std::size_t channels, parameter_spans ext, params p, System sys, bool owning)
        : p_(p), s_(channels, sys) {
        LOCKSTEP_REQUIRE(channels >= 1 && p.eps > 0 && p.momentum >= 0 && p.momentum <= 1,
                         errc::invalid_argument, -1, "batch_norm", "channels = ", channels,
                         ", eps = ", p.eps, ", momentum = ", p.momentum,
                         " (need channels >= 1, eps > 0, 0 <= momentum <= 1)");
        auto own = s_.own.span();
        if (owning || !p.affine) {
            s_.gamma = own.first(channels);
            s_.beta = own.subspan(channels, channels);
            if (p.affine) {
                s_.dgamma = own.subspan(2 * channels, channels);
                s_.dbeta = own.subspan(3 * channels, channels);
            }
        }
        if (!owning) {
            LOCKSTEP_REQUIRE(
                p.affine && ext.gamma.size() == channels && ext.beta.size() == channels &&
                    ext.dgamma.size() == channels && ext.dbeta.size() == channels,
                errc::shape_mismatch, -1, "batch_norm",
                "external parameters need affine = true and ", channels, " values each, got gamma ",
                ext.gamma.size(), ", beta ", ext.beta.size(), ", dgamma ", ext.dgamma.size(),
                ", dbeta ", ext.dbeta.size());
            s_.gamma = ext.gamma;
            s_.beta = ext.beta;
            s_.dgamma = ext.dgamma;
            s_.dbeta = ext.dbeta;
        }
        detail::fill(s_.sys, s_.gamma, param_type(1));
        detail::fill(s_.sys, s_.beta, param_type(0));
        detail::fill(s_.sys, s_.dgamma, param_type(0));
        detail::fill(s_.sys, s_.dbeta, param_type(0));
        reset_running_stats();
    }

    static std::span<const param_type> const_span(std::span<param_type> s) { return s; }

    std::string check_input(std::size_t x_size, const tensor_shape& shape,
                            std::size_t y_size) const {
        if (shape.rank() != Layout::rank)
            return lockstep::detail::concat("expected a rank-", Layout::rank, " ", Layout::name,
                                            " tensor, got shape ", shape, " of rank ",
                                            shape.rank());
        if (shape[Layout::channel_axis] != s_.channels)
            return lockstep::detail::concat("the layer has ", s_.channels, " channels, the input ",
                                            shape[Layout::channel_axis], " (shape ", shape, ", ",
                                            Layout::name, ")");
        if (x_size != shape.elements() || y_size != shape.elements())
            return lockstep::detail::concat("shape ", shape, " has ", shape.elements(),
                                            " values, x has ", x_size, " and y ", y_size);
        return {};
    }

    /// bn::group: the sub-communicator of this replica's group (split once, then cached for
    /// this parent communicator); every other policy: comm itself.
    template <class Comm>
    Comm& statistics_communicator(Comm& comm) {
        if constexpr (is_group) {
            if (group_parent_ != &comm || group_type_ != &typeid(Comm) || !group_comm_) {
                const int rank = comm.rank();
                group_comm_ =
                    std::shared_ptr<Comm>(new Comm(comm.split(rank / Policy::size, rank)));
                group_parent_ = &comm;
                group_type_ = &typeid(Comm);
            }
            return *static_cast<Comm*>(group_comm_.get());
        } else {
            return comm;
        }
    }

    /// The world rank of member r of this replica's statistics communicator.
    static int world_rank(int rank, int r) {
        if constexpr (is_group)
            return rank / Policy::size * Policy::size + r;
        return r;
    }
    static constexpr int tower_replica() {
        if constexpr (is_tower)
            return Policy::replica;
        return 0;
    }

    /// The one forward collective: all_gather of {status, count, (mean, m2) per channel}.
    /// ensures: s_.gathered holds every replica's block; returns each replica's count, or -1
    /// for a replica that reported invalid input.
    template <class Comm>
    std::vector<param_type> exchange_moments(Comm& sc, int status, param_type count) {
        const std::size_t block = 2 + 2 * s_.channels;
        const auto replicas = static_cast<std::size_t>(sc.size());
        kernels::detail::for_each_index(
            s_.sys, s_.channels,
            kernels::pack_moments_fn<param_type>{s_.local.data(), param_type(status), count,
                                                 s_.packed.data()});
        auto gathered = detail::ensure(s_.gathered, replicas * block, s_.sys);
        sc.all_gather(std::span<const param_type>(s_.packed.span()), gathered);
        std::vector<param_type> host;
        if constexpr (System::is_host) {
            host.assign(gathered.begin(), gathered.end());
        } else {
            host = detail::to_host(s_.sys, std::span<const param_type>(gathered));
        }
        std::vector<param_type> counts(replicas);
        for (std::size_t r = 0; r < replicas; ++r)
            counts[r] = host[r * block] != 0 ? param_type(-1) : host[r * block + 1];
        return counts;
    }

    params p_;
    detail::bn_state<param_type, System> s_;
    std::int64_t batches_ = 0;
    std::span<const T> saved_x_{};
    kernels::channel_geometry saved_geometry_{};
    param_type saved_count_ = 0;
    bool has_forward_ = false;
    std::shared_ptr<void> group_comm_;
    const void* group_parent_ = nullptr;
    const std::type_info* group_type_ = nullptr;
};

} // namespace lockstep::nn
