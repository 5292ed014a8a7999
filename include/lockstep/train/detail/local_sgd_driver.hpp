// lockstep/train/detail/local_sgd_driver.hpp: the step driver of sync::local_sgd<K>: each
// replica steps alone, the weights and state are averaged over replicas every K steps.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/error.hpp"
#include "lockstep/policy/sync.hpp"
#include "lockstep/train/detail/agreement.hpp"
#include "lockstep/train/detail/gradient_collective.hpp"
#include "lockstep/train/detail/host_collective.hpp"
#include "lockstep/train/detail/reduce_functors.hpp"
#include "lockstep/train/detail/step_driver.hpp"
#include "lockstep/train/detail/trainer_ordinal.hpp"

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace lockstep::detail {

/// sync::local_sgd<K> with any ReducePolicy whose collective averages (its plan only cuts the
/// checks into pieces and averages the values): scale = 1 / (this replica's samples); the skip
/// decision is this replica's own (no status collective); every K-th step, and at finish() when
/// steps ran since, average(): the replicas' trainer (its ordinal on the communicator,
/// trainer_ordinal.hpp) and {global_batch, lr} since the last check (average or checkpoint
/// save) are compared, then values and state become the mean over replicas.
template <std::size_t K>
class step_driver<sync::local_sgd<K>> {
public:
    /// requires: train_params::verify_every a multiple of K (else lockstep::error,
    /// invalid_argument): the replicas hold the same weights only right after an average (a
    /// negative value is the trainer's to refuse).
    template <class Stages>
    explicit step_driver(Stages& s) {
        const std::int64_t every = s.core().params().verify_every;
        LOCKSTEP_REQUIRE(every < 0 || every % static_cast<std::int64_t>(K) == 0,
                         errc::invalid_argument, s.rank(), "data_parallel",
                         "verify_every = ", every, " is not a multiple of local SGD's period ", K,
                         ": the replicas hold the same weights only right after an average");
        s.set_local_sgd(true);
    }

    template <class Stages, class Collective, class Fn>
    requires averaging_collective<Collective, typename Stages::T>
        step_result step(Stages& s, Collective& c, std::size_t global, Fn& fn) {
        const shard_extent all = s.core().optimizer_shard(); // every element
        s.begin(0);
        s.zero();
        const double loss = s.forward_backward(global, fn, true, no_ready_hook{});
        s.pack_gradients();
        s.unscale();
        s.check_pieces(c.plan());
        step_result r = s.open_result();
        s.report(loss, global, r.lr);
        settings_.push_back(static_cast<double>(global));
        settings_.push_back(r.lr);
        s.freeze();
        s.hook();
        s.check(all);
        s.decide(s.rank(), 1); // this replica alone: no status collective
        s.update_scale();
        s.count_skip(s.replicas()); // this replica's own run: only its row is set
        s.commit();
        s.set_lr(r.lr);
        s.clip(all);
        s.update(all);
        r = s.end(global, r);
        if (++since_average_ == K)
            average(s, c);
        return r;
    }

    /// After the last step: an average when steps ran since the last one (collective).
    template <class Stages, class Collective>
    void finish(Stages& s, Collective& c) {
        if (since_average_ > 0)
            average(s, c);
    }

    /// Before a checkpoint save (collective): the steps since the last check compared as the
    /// average compares them, so a saved run never hides a disagreement from the next average.
    template <class Stages>
    void verify_before_save(Stages& s) {
        verify_steps(s, "save_checkpoint");
    }

    /// Steps since the last average (what a checkpoint keeps).
    std::size_t since_average() const noexcept { return since_average_; }
    void set_since_average(std::size_t n) noexcept { since_average_ = n; }

private:
    /// Values and state become the mean over replicas (collective).
    template <class Stages, class Collective>
    void average(Stages& s, Collective& c) {
        since_average_ = 0;
        verify_steps(s, "data_parallel.average");
        auto& core = s.core();
        auto& comm = core.comm();
        using T = typename Stages::T;
        c.average(core.values());
        core.pack_state();
        core.for_each_state_buffer([&](std::span<T> b) {
            comm.all_reduce(std::span<const T>(b), b, reduce_op::sum);
            scale(comm.system(), b, T(1) / static_cast<T>(comm.size()));
        });
        core.unpack_values();
        core.unpack_state();
    }

    /// Every replica's trainer ordinal and {global_batch, lr} of each step recorded since the
    /// last check (an average or a save: each step is checked once) compared (collective: one
    /// all_gather of the ordinal and step counts, one of the settings, sized by the steps taken,
    /// not by K); another trainer throws lockstep::error on every replica naming both ordinals
    /// (invalid_argument: the replicas step their trainers in another order), a difference in
    /// the settings naming the step and both values (invalid_argument), another step count
    /// naming both counts (count_mismatch).
    template <class Stages>
    void verify_steps(Stages& s, const char* op) {
        auto& comm = s.core().comm();
        const std::int64_t steps = s.core().steps();
        const std::array<std::int64_t, 3> mine{steps, static_cast<std::int64_t>(settings_.size()),
                                               static_cast<std::int64_t>(s.core().ordinal())};
        std::vector<std::int64_t> counts(3 * static_cast<std::size_t>(comm.size()));
        // Named after op: a replica in a save and one in an average are told apart here.
        host_all_gather(comm, std::span<const std::int64_t>(mine), std::span<std::int64_t>(counts),
                        collective_tag(op));
        for (int r = 1; r < comm.size(); ++r) {
            const std::size_t at = 3 * static_cast<std::size_t>(r);
            if (counts[at + 2] != counts[2])
                fail(errc::invalid_argument, comm.rank(), op,
                     trainer_order_text(r, static_cast<double>(counts[at + 2]),
                                        static_cast<double>(counts[2])),
                     " (local SGD, checked at the average or save)");
        }
        for (int r = 1; r < comm.size(); ++r) {
            const std::size_t at = 3 * static_cast<std::size_t>(r);
            if (counts[at] != counts[0] || counts[at + 1] != counts[1])
                fail(errc::count_mismatch, comm.rank(), op,
                     "the replicas ran different numbers of steps (local SGD): ", counts[0],
                     " on replica 0 (", counts[1] / 2, " since the last check), ", counts[at],
                     " on replica ", r, " (", counts[at + 1] / 2,
                     "): every replica calls step() as often");
        }
        const std::size_t width = settings_.size();
        const std::int64_t first = steps - static_cast<std::int64_t>(width / 2);
        std::vector<double> all(width * static_cast<std::size_t>(comm.size()));
        host_all_gather(comm, std::span<const double>(settings_), std::span<double>(all),
                        collective_tag(op));
        settings_.clear();
        std::string out;
        for (int r = 1; r < comm.size(); ++r)
            for (std::size_t k = 0; k < width / 2; ++k) {
                const double* a = all.data() + 2 * k;
                const double* b = all.data() + static_cast<std::size_t>(r) * width + 2 * k;
                if (a[0] != b[0])
                    out += concat(" step ", first + static_cast<std::int64_t>(k),
                                  ": global_batch: ", a[0], " on replica 0, ", b[0], " on replica ",
                                  r, ";");
                if (a[1] != b[1])
                    out += concat(" step ", first + static_cast<std::int64_t>(k),
                                  ": lr: ", exact(a[1]), " on replica 0, ", exact(b[1]),
                                  " on replica ", r, ";");
            }
        if (!out.empty())
            fail(errc::invalid_argument, comm.rank(), op,
                 "the replicas disagree (local SGD, checked at the average or save):", out);
    }

    std::size_t since_average_ = 0;
    std::vector<double> settings_; ///< {global_batch, lr} per step since the last check
};

} // namespace lockstep::detail
