// lockstep/train/detail/checkpoint_metadata.hpp: what a shard's metadata records of a trainer
// (describe_trainer: element type, replicas, optimizer, policies, frozen tensors, learning-rate
// schedule) and why a checkpoint with another frozen set, learning rate or hyperparameter is
// refused, with the way to train on with the new one.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/error.hpp"
#include "lockstep/optim/adam.hpp"
#include "lockstep/optim/lamb.hpp"
#include "lockstep/optim/lars.hpp"
#include "lockstep/optim/sgd.hpp"
#include "lockstep/policy/bn.hpp"
#include "lockstep/policy/compat.hpp"
#include "lockstep/policy/reduce.hpp"
#include "lockstep/policy/sync.hpp"
#include "lockstep/train/detail/agreement.hpp"
#include "lockstep/train/detail/checkpoint_access.hpp"
#include "lockstep/train/detail/checkpoint_format.hpp"
#include "lockstep/train/detail/optimizer_shard.hpp"
#include "lockstep/train/detail/signature.hpp"
#include "lockstep/train/loss_scaler.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

namespace lockstep::detail::ckpt {

using meta_list = std::vector<std::pair<std::string, std::string>>;

/// The optimizer's name and hyperparameters, as the agreement check describes them
/// (describe_optimizer_params) under "optimizer.<name>"; the learning rate is left out (it is
/// recorded with the schedule, see describe_trainer).
template <class P>
void describe_optimizer(meta_list& m, const P& p) {
    static_assert(std::is_same_v<P, optim::sgd_params> || std::is_same_v<P, optim::adam_params> ||
                      std::is_same_v<P, optim::adamw_params> ||
                      std::is_same_v<P, optim::lars_params> ||
                      std::is_same_v<P, optim::lamb_params>,
                  "checkpoints record sgd, adam, adamw, lars and lamb.");
    m.emplace_back("optimizer", std::is_same_v<P, optim::sgd_params>     ? "sgd"
                                : std::is_same_v<P, optim::adam_params>  ? "adam"
                                : std::is_same_v<P, optim::adamw_params> ? "adamw"
                                : std::is_same_v<P, optim::lars_params>  ? "lars"
                                                                         : "lamb");
    std::vector<std::string> settings;
    describe_optimizer_params(settings, p);
    for (const std::string& line : settings) {
        const std::size_t tab = line.find('\t');
        if (line.compare(0, tab, "lr") != 0)
            m.emplace_back("optimizer." + line.substr(0, tab), line.substr(tab + 1));
    }
}

/// True for the trainers that keep a dynamic loss scale (data_parallel::scaler()).
template <class DP>
concept has_loss_scaler = requires(DP& dp) {
    dp.scaler().state();
};

/// The replica a shard was written by: its rank among world_size replicas.
struct shard_owner {
    int world_size = 1;
    int rank = 0;
    /// The asynchronous trainers' server the shard records (-1: the trainer's own). A load may
    /// change the server: the saved one's shard is then restored (read_source_shard).
    int async_root = -1;
};

/// The replica dp is.
template <class DP>
shard_owner own_shard(DP& dp) {
    auto& comm = checkpoint_access::core(dp).comm();
    return {comm.size(), comm.rank()};
}

/// With reduce::sharded, the elements of the n-element flat buffer whose optimizer state
/// replica `as` holds: its extent of shard_layout(n, as.world_size), computed alone (the world
/// size may come from a file: no allocation that grows with it).
inline shard_extent owned_extent(std::size_t n, shard_owner as) {
    const shard_range s = shard(0, n, as.rank, as.world_size);
    return {s.begin, s.size()};
}

/// The metadata value "frozen": the names of dp's frozen parameters (train_params::frozen),
/// sorted (the set, whatever the registration order), e.g. "{bn1.weight,fc1.weight}".
template <class DP>
std::string frozen_names(DP& dp) {
    auto& core = checkpoint_access::core(dp);
    std::vector<std::string> names;
    for (std::size_t i : core.frozen())
        names.push_back(core.registry().parameters()[i].name);
    std::sort(names.begin(), names.end());
    std::string s;
    for (const std::string& n : names)
        s += (s.empty() ? "" : ",") + n;
    return "{" + s + "}";
}

/// Why a checkpoint whose frozen set is `saved` cannot resume in a trainer whose set is
/// `trainer` (the values of "frozen", which differ), naming the tensors unfrozen and frozen
/// since the save and how to train with another set. The optimizer keeps one step count for
/// every tensor (kernels/optimizer_kernels.hpp begin_step), so a tensor trained after the load
/// but not before would start Adam's bias correction and momentum's first step mid-run, where
/// torch (a count per parameter) starts them afresh.
inline std::string frozen_refusal(std::string_view saved, std::string_view trainer) {
    const auto names = [](std::string_view v) {
        std::vector<std::string_view> out;
        if (v.size() >= 2 && v.front() == '{' && v.back() == '}')
            v = v.substr(1, v.size() - 2);
        while (!v.empty()) {
            const std::size_t c = v.find(',');
            out.push_back(v.substr(0, c));
            v = c == std::string_view::npos ? std::string_view{} : v.substr(c + 1);
        }
        return out;
    };
    const auto was = names(saved), now = names(trainer);
    const auto missing_from = [](const auto& a, const auto& b) {
        std::string s;
        for (std::string_view n : a)
            if (std::find(b.begin(), b.end(), n) == b.end())
                s += concat(s.empty() ? "" : ", ", n);
        return s;
    };
    const std::string unfrozen = missing_from(was, now), newly = missing_from(now, was);
    return concat("frozen: checkpoint ", saved, ", trainer ", trainer, " (",
                  unfrozen.empty() ? "" : "unfrozen since the save: " + unfrozen,
                  !unfrozen.empty() && !newly.empty() ? "; " : "",
                  newly.empty() ? "" : "frozen since the save: " + newly,
                  "): a checkpoint resumes with the frozen set it was saved with (the optimizer "
                  "keeps one step count for every tensor, so a tensor frozen at the save and "
                  "trained after the load would get Adam's bias correction and momentum's "
                  "first-step start at the run's step count, where torch starts them at the "
                  "tensor's own first step); load it with that set, then construct a new trainer "
                  "with the new set whose network starts from the loaded parameters (a fresh "
                  "optimizer, as a new torch optimizer would start)");
}

/// Why a checkpoint whose metadata `key` holds `saved` cannot resume in a trainer whose value is
/// `trainer` (they differ): "key: checkpoint saved, trainer trainer", with the way to train on
/// with the new value where one exists (the frozen set, the learning rate, the optimizer's other
/// hyperparameters).
inline std::string setting_refusal(std::string_view key, std::string_view saved,
                                   std::string_view trainer) {
    if (key == "frozen")
        return frozen_refusal(saved, trainer);
    std::string differ = concat(key, ": checkpoint ", saved, ", trainer ", trainer);
    // The optimizer takes its rate from train_params::lr when set, else from its params' lr,
    // which set_lr changes (and the next save records).
    if (key == "lr.schedule")
        return differ + " (the learning rate at the resume step and 1, 10 and 1000 steps later): "
                        "a checkpoint resumes with the learning rates it was saved with; to go on "
                        "at another rate, load it into a trainer built with the saved rate (the "
                        "optimizer's lr, or the same train_params::lr), then call "
                        "optimizer().set_lr(x) on every replica before the next step (a trainer "
                        "without train_params::lr: a schedule sets every step's rate)";
    if (key.substr(0, 10) == "optimizer.")
        return differ + ": a checkpoint resumes with the optimizer's hyperparameters it was saved "
                        "with (only the learning rate has a setter, optimizer().set_lr); load it "
                        "with them, then construct a new trainer with the new values whose "
                        "network starts from the loaded parameters (a fresh optimizer, as a new "
                        "torch optimizer would start)";
    return differ;
}

/// Everything the metadata of a shard records about the trainer dp when it has taken `steps`
/// steps: element type, world size and rank, optimizer and hyperparameters, policies, the frozen
/// tensors, and the learning rate at steps, steps + 1, + 10 and + 1000 (the schedule's position
/// and continuation; "undefined" at a step past `steps` where the schedule throws, e.g. a table
/// of the run's length, so that such a schedule saves and resumes).
/// `as`: the replica the shard describes (its world size, rank and, with reduce::sharded, its
/// shard of the optimizer state); dp's own unless a checkpoint of another replica count is read.
/// throws: lockstep::error (checkpoint, no replica: the save or load that called names it) when
/// the schedule throws at `steps`, naming the step and the schedule's exception.
template <class DP>
meta_list describe_trainer(DP& dp, std::int64_t steps, shard_owner as) {
    using T = typename DP::value_type;
    auto& core = checkpoint_access::core(dp);
    meta_list m;
    m.emplace_back("trainer", "data_parallel");
    m.emplace_back("dtype", element_name<T>());
    m.emplace_back("dtype.size", std::to_string(sizeof(T)));
    m.emplace_back("world_size", std::to_string(as.world_size));
    m.emplace_back("rank", std::to_string(as.rank));
    describe_optimizer(m, core.optimizer().params());
    m.emplace_back("sync", DP::sync_policy_type::name());
    m.emplace_back("reduce", DP::reduce_policy_type::name());
    m.emplace_back("bn", bn_policy_names<network_bn_policies_t<typename DP::network_type>>::get());
    m.emplace_back("frozen", frozen_names(dp));
    if constexpr (DP::reduce_policy_type::shards_optimizer_state) {
        // The optimizer sections hold this replica's shard only: restoring needs the same one.
        const shard_extent own = owned_extent(core.values().size(), as);
        m.emplace_back("reduce.shard", concat("[", own.offset, ", ", own.offset + own.count,
                                              ") of ", core.values().size()));
    }
    if constexpr (is_asynchronous_v<typename DP::sync_policy_type>) {
        m.emplace_back("async.root",
                       std::to_string(as.async_root >= 0 ? as.async_root : dp.params().root));
        m.emplace_back("async.bn_momentum", exact(dp.params().bn_momentum));
    }
    if constexpr (has_loss_scaler<DP>) {
        // The dynamic loss scale's knobs (its state is the section "trainer.loss_scale").
        const auto& sc = dp.scaler();
        if (sc.enabled()) {
            const loss_scaling& c = sc.config();
            m.emplace_back("loss_scale", "dynamic");
            m.emplace_back("loss_scale.growth_factor", exact(c.growth_factor));
            m.emplace_back("loss_scale.backoff_factor", exact(c.backoff_factor));
            m.emplace_back("loss_scale.growth_interval", std::to_string(c.growth_interval));
        } else {
            m.emplace_back("loss_scale", "none");
        }
    }
    std::string lr;
    for (std::int64_t ahead : {0, 1, 10, 1000}) {
        std::string v;
        try {
            v = exact(core.lr_for(steps + ahead));
        } catch (const std::exception& e) {
            if (ahead == 0)
                fail(errc::checkpoint, -1, "train_params::lr",
                     "the learning rate schedule threw at step ", steps,
                     ", the step the checkpoint resumes at (a checkpoint records the rate of that "
                     "step and, where the schedule defines them, of 1, 10 and 1000 steps later): ",
                     e.what());
            v = "undefined";
        }
        lr += (lr.empty() ? "" : " ") + v;
    }
    m.emplace_back("lr.schedule", lr);
    return m;
}

} // namespace lockstep::detail::ckpt
