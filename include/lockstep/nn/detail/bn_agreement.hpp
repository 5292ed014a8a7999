// lockstep/nn/detail/bn_agreement.hpp: settings_agreement, the check that the replicas sharing a
// batch-norm layer's statistics built their layers alike. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/communicator.hpp"
#include "lockstep/comm/host_wait.hpp"
#include "lockstep/core/config.hpp"
#include "lockstep/core/detail/fnv1a.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/kernels/for_each.hpp"
#include "lockstep/nn/batch_norm_params.hpp"
#include "lockstep/system/buffer.hpp"
#include "lockstep/system/staged_read.hpp"

#include <array>
#include <charconv>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

namespace lockstep::nn::detail {

/// dst[i] = v[i]: host values written into a buffer of the system's memory by a launch on its
/// stream (no blocking copy while a peer may wait in a collective).
template <std::size_t N>
struct write_values_fn {
    double v[N];
    double* dst;
    LOCKSTEP_HOST_DEVICE void operator()(std::size_t i) const { dst[i] = v[i]; }
};

/// Each replica builds its own layer, so nothing but this check makes the replicas that train a
/// layer (and share its statistics) use one eps, momentum, affine, channel count and BN policy:
/// with another
/// eps on one replica, bn::global's replicas normalize the same merged statistics differently
/// and train, still identical to each other, away from the one-replica result; with another
/// momentum the running statistics the sharing policies keep equal drift apart. check() runs
/// once per layer, before its first statistics collective: one all_reduce (max) of each
/// setting as {v, -v}, which gives every replica the highest and lowest value, compared exactly.
/// A mismatch throws lockstep::error (invalid_argument) on every replica of the communicator
/// (bn::group: of every group), naming the layer, each differing setting with this replica's
/// value and the range, and the fix.
class settings_agreement {
    /// policy hash (two halves), channels, eps, momentum, affine: values() (declared first, so
    /// that every use below sees it).
    static constexpr std::size_t settings = 6;

public:
    settings_agreement() = default;
    /// `policy`: the layer's BN policy name (bn::traits<P>::name()).
    settings_agreement(std::string_view policy, std::size_t channels, const batch_norm_params& p)
        : policy_(policy), channels_(channels), p_(p) {}

    /// True once the check passed (or was never needed).
    bool done() const noexcept { return done_; }
    /// Names the layer in the check's error by its number in forward order within a step
    /// (nn::layer_step::next_layer()) at its first call there (bn::ghost runs once per chunk
    /// before its check); unnamed outside a step.
    void set_layer(int forward_index) noexcept {
        if (layer_ < 0)
            layer_ = forward_index;
    }

    /// The check over `comm` (every replica that trains the layer), once: a no-op after it
    /// passed. Collective on comm the first time: every replica of comm calls it at the same
    /// point (before the layer's first statistics collective). One host synchronisation.
    template <communicator Comm>
    void check(Comm& comm, const char* op) {
        if (done_)
            return;
        using System = typename Comm::system_type;
        const System sys = comm.system();
        const std::array<double, settings> mine = values();
        std::array<double, 12> send{}; // {v, -v} per setting (a literal: cppcheck misreads
                                       // 2 * settings here)
        static_assert(send.size() == 2 * settings);
        for (std::size_t i = 0; i < mine.size(); ++i) {
            send[2 * i] = mine[i];
            send[2 * i + 1] = -mine[i];
        }
        // Every allocation before the collective is enqueued (pinned memory taken between an
        // NCCL enqueue and its wait can deadlock with another thread's NCCL call).
        buffer<double, System> exchanged(send.size(), sys);
        staged_read<double, System> back(send.size(), sys);
        write_values_fn<2 * settings> w{{}, exchanged.data()};
        for (std::size_t i = 0; i < send.size(); ++i)
            w.v[i] = send[i];
        kernels::for_each_index(sys, send.size(), w, send.size());
        const std::span<const double> in(exchanged.span());
        static constexpr std::string_view tag = "batch_norm.forward_train: settings check";
        if constexpr (requires { comm.all_reduce(in, exchanged.span(), reduce_op::max, tag); })
            comm.all_reduce(in, exchanged.span(), reduce_op::max, tag);
        else
            comm.all_reduce(in, exchanged.span(), reduce_op::max);
        back.enqueue(in);
        const std::span<const double> agreed = wait_for(comm, back, op);
        std::string problems;
        const auto differs = [&](std::size_t i) { return agreed[2 * i] != -agreed[2 * i + 1]; };
        if (differs(0) || differs(1))
            problems += lockstep::detail::concat("; BN policy: ", policy_,
                                                 " here, another on a replica that shares them");
        static constexpr const char* names[settings] = {"",    "",         "channels",
                                                        "eps", "momentum", "affine"};
        for (std::size_t i = 2; i < settings; ++i)
            if (differs(i))
                problems +=
                    lockstep::detail::concat("; ", names[i], ": ", shown(i, mine[i]),
                                             " here, from ", shown(i, -agreed[2 * i + 1]), " to ",
                                             shown(i, agreed[2 * i]), " over the replicas");
        if (!problems.empty())
            fail(errc::invalid_argument, comm.rank(), op, "the ", comm.size(),
                 " replicas that train this layer (",
                 layer_ >= 0
                     ? lockstep::detail::concat("batch_norm layer ", layer_, " in forward order, ")
                     : std::string(),
                 policy_, ", ", channels_, " channels) built it with different settings (",
                 std::string_view(problems).substr(2),
                 "): construct every replica's layer with the same batch_norm_params, channel "
                 "count and BN policy (else each replica trains with its own settings, and N "
                 "replicas no longer train like one)");
        done_ = true;
    }

private:
    /// policy hash (low and high 32 bits, exact in a double), channels, eps, momentum, affine.
    std::array<double, settings> values() const {
        const std::uint64_t h = lockstep::detail::fnv1a(policy_);
        return {static_cast<double>(h & 0xffffffffu),
                static_cast<double>(h >> 32),
                static_cast<double>(channels_),
                p_.eps,
                p_.momentum,
                p_.affine ? 1.0 : 0.0};
    }

    /// A value as the message shows it: the shortest text that reads back to it.
    static std::string shown(std::size_t i, double v) {
        if (i == 5)
            return v != 0 ? "true" : "false";
        char buf[32];
        return {buf, std::to_chars(buf, buf + sizeof buf, v).ptr};
    }

    std::string policy_;
    std::size_t channels_ = 0;
    batch_norm_params p_{};
    int layer_ = -1;
    bool done_ = false;
};

} // namespace lockstep::nn::detail
