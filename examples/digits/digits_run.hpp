// examples/digits/digits_run.hpp: command-line options of the digits demo and the training run for
// one compiled policy combination. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "digits_data.hpp"
#include "mlp.hpp"

#include <lockstep/optim/adam.hpp>
#include <lockstep/optim/lamb.hpp>
#include <lockstep/optim/lars.hpp>
#include <lockstep/optim/sgd.hpp>
#include <lockstep/policy/bn.hpp>
#include <lockstep/policy/reduce.hpp>
#include <lockstep/policy/sync.hpp>
#include <lockstep/train/async_checkpoint.hpp>
#include <lockstep/train/asynchronous.hpp>
#include <lockstep/train/checkpoint.hpp>
#include <lockstep/train/data_parallel.hpp>

#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>

namespace digits {

/// What a thread lost by --lose-at throws: its thread catches it and ends.
struct lost_thread {};

/// The replica `comm` stands for: its thread_group index, which a shrink keeps (ranks are
/// renumbered), else its rank.
template <class Comm>
int replica_of(const Comm& comm) {
    if constexpr (requires { comm.replica(); })
        return comm.replica();
    else
        return comm.rank();
}

/// What the command line asks for (see usage() in digits.cpp).

struct options {
    int replicas = 4;
    int epochs = 20;
    std::size_t batch = 64; ///< global batch (synchronous, local SGD); async: per worker batch
                            ///< = batch / workers, rounded up
    double lr = -1;         ///< < 0: the optimizer's default for this demo
    std::uint64_t seed = 1;
    std::string sync = "sync", reduce = "bucketed", optim = "sgd", bn = "local";
    int hidden = 128;
    float dropout = 0.1f;
    bool mpi = false;
    bool progress = true;
    std::string data;
    std::string save;                 ///< checkpoint written after the last step (empty: none)
    std::string resume;               ///< checkpoint loaded before the first step (empty: none)
    std::size_t steps = 0;            ///< stop after this many steps in total (0: all epochs)
    std::string checkpoint;           ///< resumed from when it exists, saved to (empty: none)
    std::size_t checkpoint_every = 0; ///< also save to `checkpoint` every this many steps
    bool checkpoint_async = false;    ///< those saves in the background (--sync sync)
    /// Fault injection: replica `rank` SIGKILLs itself (stall: sleeps for 10 minutes) before
    /// step `step` in a job's first launch (none: rank < 0).
    struct fault_injection {
        std::size_t step = 0;
        int rank = -1;
        bool stall = false;
    } fault;
    /// Fault injection on the thread group: replica `rank`'s thread ends before step `step`
    /// (it throws lost_thread, which its thread catches); none: rank < 0.
    fault_injection lose{};
    bool shrink = false; ///< train_params::on_replica_failure = shrink (threads, --sync sync)
};

/// True in the first launch of a job (tools/lockstep-run sets LOCKSTEP_RUN_ATTEMPT; a program
/// started otherwise is in its first launch).
inline bool first_launch() {
    const char* attempt = std::getenv("LOCKSTEP_RUN_ATTEMPT");
    return attempt == nullptr || std::string_view(attempt) == "0";
}

/// What a run measured (printed by rank 0).
struct result {
    double accuracy = 0, samples_per_s = 0, seconds = 0;
    double final_loss = 0;   ///< the last step's loss (0 when this run made no step)
    std::size_t samples = 0; ///< samples trained by this run (0: no step, e.g. --resume from
                             ///< step N with --steps N)
    std::size_t steps = 0;   ///< the step the final weights are after (synchronous, local SGD:
                             ///< the trainer's steps(), counting the resumed checkpoint's)
    std::string staleness;   ///< async only: "max M, mean X, histogram ..."
    std::uint64_t weights_hash = 0; ///< FNV-1a of the final parameters' bytes (synchronous,
                                    ///< local SGD): equal hashes are bitwise equal weights
};

/// FNV-1a (64 bits) of the bytes of a span of values.
template <class T>
std::uint64_t fnv1a_bytes(std::span<const T> v) {
    std::uint64_t h = 14695981039346656037ull;
    const auto* p = reinterpret_cast<const unsigned char*>(v.data());
    for (std::size_t i = 0; i < v.size_bytes(); ++i)
        h = (h ^ p[i]) * 1099511628211ull;
    return h;
}

/// A progress bar on stderr: [#####.....] epoch e/E loss L N samples/s (redrawn at most every
/// 100 ms).
class progress_bar {
public:
    progress_bar(bool on, std::size_t total) : on_(on), total_(total) {}
    void update(std::size_t done, double loss, double samples_per_s, int epoch, int epochs) {
        if (!on_)
            return;
        const auto now = std::chrono::steady_clock::now();
        if (done < total_ && now - last_ < std::chrono::milliseconds(100))
            return;
        last_ = now;
        const int width = 30;
        const int filled = int(double(width) * double(done) / double(total_));
        std::string bar(std::size_t(filled), '#');
        bar.resize(width, '.');
        std::fprintf(stderr, "\r[%s] epoch %d/%d  loss %.4f  %8.0f samples/s", bar.c_str(), epoch,
                     epochs, loss, samples_per_s);
        if (done >= total_)
            std::fprintf(stderr, "\n");
        std::fflush(stderr);
    }

private:
    bool on_;
    std::size_t total_;
    std::chrono::steady_clock::time_point last_{};
};

/// The optimizer's params from the options (defaults tuned for this demo).
template <class Optim>
typename Optim::params_type optimizer_params(const options& o) {
    using P = typename Optim::params_type;
    P p{};
    if constexpr (std::is_same_v<P, lockstep::optim::sgd_params>) {
        p.lr = 0.05;
        p.momentum = 0.9;
    } else if constexpr (std::is_same_v<P, lockstep::optim::lars_params>) {
        p.lr = 0.2; // biases and BN parameters (no trust ratio) step with this lr directly
        p.momentum = 0.9;
        p.eta = 0.02;
        p.weight_decay = 1e-4;
    } else if constexpr (std::is_same_v<P, lockstep::optim::lamb_params>) {
        p.lr = 0.01;
    } else { // adam, adamw
        p.lr = 0.003;
    }
    if (o.lr >= 0)
        p.lr = o.lr;
    return p;
}

/// Trains the MLP with one compiled combination of policies on this replica's communicator and
/// evaluates it. Collective: every replica calls it.
/// The save before every --checkpoint-every-th step: in the background with
/// --checkpoint-async (synchronous trainers: a later step commits it), else blocking.
template <class Trainer>
void save_periodic(Trainer& trainer, const options& o) {
    if constexpr (std::is_same_v<typename Trainer::sync_policy_type, lockstep::sync::synchronous>)
        if (o.checkpoint_async) {
            lockstep::save_checkpoint_async(trainer, o.checkpoint);
            return;
        }
    lockstep::save_checkpoint(trainer, o.checkpoint);
}

template <class Sync, class Reduce, class Optim, class BN, class Comm>
result train_and_evaluate(Comm& comm, const options& o, const split_data& data) {
    using net = mlp<BN>;
    using trainer_type = lockstep::data_parallel<net, Optim, Sync, Reduce, Comm>;
    const mlp_options mo{.hidden = o.hidden, .dropout = o.dropout};
    const bool root = comm.rank() == 0;
    const std::size_t n = data.train.size();
    const std::size_t total = n * static_cast<std::size_t>(o.epochs);
    const sampler order(n, static_cast<std::size_t>(o.epochs) + 1, o.seed);

    lockstep::train_params tp{.seed = o.seed, .decay = [](const lockstep::tensor_info& t) {
                                  return t.name.ends_with(".weight");
                              }};
    if (o.shrink)
        tp.on_replica_failure = lockstep::replica_failure::shrink;
    auto factory = [&](auto& ctx) { return net(mo, ctx.system()); };
    auto fn = [&](net& m, const lockstep::shard_range& r, auto& ctx) {
        return m.train(ctx, data.train, order, r);
    };

    result res;
    progress_bar bar(o.progress && root, total);
    comm.barrier();
    const auto start = std::chrono::steady_clock::now();
    auto rate = [&](std::size_t done) {
        const double s =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        return s > 0 ? double(done) / s : 0.0;
    };
    auto epoch_of = [&](std::size_t done) { return std::min(o.epochs, int(done / n) + 1); };

    if constexpr (lockstep::is_asynchronous_v<Sync>) {
        if (!o.save.empty() || !o.resume.empty() || o.steps > 0 || !o.checkpoint.empty())
            lockstep::fail(lockstep::errc::unsupported, comm.rank(), "digits",
                           "--save, --resume, --checkpoint and --steps need --sync sync or "
                           "local:K");
        const auto workers = static_cast<std::size_t>(comm.size() - 1);
        const std::size_t batch = (o.batch + workers - 1) / workers;
        const std::size_t steps = (total + batch - 1) / batch;
        std::size_t done = 0;
        lockstep::async_params ap{.bn_momentum = mo.bn_momentum,
                                  .on_apply = [&](const lockstep::apply_info&, double loss) {
                                      done += batch;
                                      bar.update(std::min(done, total), loss, rate(done),
                                                 epoch_of(done), o.epochs);
                                  }};
        trainer_type trainer(comm, factory, optimizer_params<Optim>(o), tp, ap);
        const auto r = trainer.train(steps, batch, fn);
        res.steps = steps;
        res.samples = steps * batch;
        res.final_loss = r.mean_loss;
        const auto& st = r.staleness;
        res.staleness = "max " + std::to_string(st.max) + ", mean " +
                        std::to_string(st.mean).substr(0, 5) + ", waits " +
                        std::to_string(st.held_back) + ", histogram";
        for (std::size_t s = 0; s < st.histogram.size(); ++s)
            if (st.histogram[s])
                res.staleness += " " + std::to_string(s) + ":" + std::to_string(st.histogram[s]);
        res.seconds =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        if (root)
            res.accuracy = trainer.network().accuracy(data.test);
    } else {
        trainer_type trainer(comm, factory, optimizer_params<Optim>(o), tp);
        if (!o.resume.empty())
            lockstep::load_checkpoint(trainer, o.resume);
        else if (!o.checkpoint.empty() && std::filesystem::exists(o.checkpoint))
            lockstep::load_checkpoint(trainer, o.checkpoint); // a relaunch: continue from it
        const auto first = static_cast<std::size_t>(trainer.steps());
        std::size_t steps = (total + o.batch - 1) / o.batch;
        if (o.steps > 0)
            steps = std::min(steps, o.steps);
        // A run never goes back: one that stopped before the checkpoint's step would report
        // step `steps` for the checkpoint's weights.
        if (steps < first && o.steps > 0)
            lockstep::fail(lockstep::errc::invalid_argument, comm.rank(), "digits", "--steps ",
                           o.steps, " is below the checkpoint's step ", first, ": give --steps ",
                           first, " or more (", first,
                           ": no new step, the checkpoint's weights), or leave --steps out");
        if (steps < first)
            lockstep::fail(lockstep::errc::invalid_argument, comm.rank(), "digits", "--epochs ",
                           o.epochs, " end at step ", steps, ", below the checkpoint's step ",
                           first, ": give the --epochs of the run that saved it");
        double loss = 0;
        for (std::size_t s = first; s < steps; ++s) {
            if (s == o.fault.step && comm.rank() == o.fault.rank && first_launch()) {
                if (!o.fault.stall)
                    std::raise(SIGKILL); // a lost replica, as tools/lockstep-run sees one
                std::this_thread::sleep_for(std::chrono::minutes(10)); // a hung one
            }
            // Replica, not rank: after the shrink the survivors' ranks are renumbered, and a
            // survivor that computes step s - 1 again must not meet this test as the lost one.
            if (s == o.lose.step && replica_of(comm) == o.lose.rank)
                throw lost_thread{}; // this thread ends: a lost replica
            if (s > first && o.checkpoint_every > 0 && s % o.checkpoint_every == 0)
                save_periodic(trainer, o);
            const auto r = trainer.step(o.batch, fn);
            loss = r.loss;
            const std::size_t done = std::min(total, (s + 1) * o.batch);
            if (root)
                bar.update(done, loss, rate(done), epoch_of(done), o.epochs);
        }
        // Saved before finish(): local SGD's final average is for evaluation, a resumed run
        // continues from the replicas' own weights as an uninterrupted one does.
        if (!o.save.empty() || !o.checkpoint.empty())
            lockstep::save_checkpoint(trainer, o.save.empty() ? o.checkpoint : o.save);
        trainer.finish();
        comm.barrier();
        res.seconds =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        res.steps = static_cast<std::size_t>(trainer.steps());
        res.samples = (steps - first) * o.batch; // 0: no step ran, final_loss stays 0
        res.final_loss = loss;
        res.weights_hash = fnv1a_bytes(trainer.parameters());
        if (comm.rank() == 0) // (after a shrink, maybe another replica than at the start)
            res.accuracy = trainer.network().accuracy(data.test);
    }
    res.samples_per_s = double(res.samples) / res.seconds;
    return res;
}

/// Calls f(type_identity<Optim>) for the --optim name; false for an unknown name.
template <class F>
bool with_optimizer(const std::string& name, F&& f) {
    namespace optim = lockstep::optim;
    if (name == "sgd")
        return f(std::type_identity<optim::sgd<float>>{}), true;
    if (name == "adam")
        return f(std::type_identity<optim::adam<float>>{}), true;
    if (name == "adamw")
        return f(std::type_identity<optim::adamw<float>>{}), true;
    if (name == "lars")
        return f(std::type_identity<optim::lars<float>>{}), true;
    if (name == "lamb")
        return f(std::type_identity<optim::lamb<float>>{}), true;
    return false;
}

/// The runs of one SyncPolicy family; each is defined in its own translation unit (they are
/// many instantiations), compiled once per communicator. They return false with `why` set when
/// the combination is invalid. run_synchronous_local_bn covers --bn local, global, group2 and
/// ghost, run_synchronous_shared_bn covers running_only and tower0.
template <class Comm>
bool run_synchronous_local_bn(Comm& comm, const options& o, const split_data& d, result& r,
                              std::string& why);
template <class Comm>
bool run_synchronous_shared_bn(Comm& comm, const options& o, const split_data& d, result& r,
                               std::string& why);
template <class Comm>
bool run_local_sgd(Comm& comm, const options& o, const split_data& d, result& r, std::string& why);
template <class Comm>
bool run_asynchronous(Comm& comm, const options& o, const split_data& d, result& r,
                      std::string& why);

} // namespace digits

namespace digits {

/// Samples per chunk of --reduce reproducible and per ghost batch of --bn ghost (the library
/// requires both to be the same).
inline constexpr std::size_t repro_chunk = 16;

/// Calls f(type_identity<ReducePolicy>) for the --reduce name; false for an unknown name.
template <class F>
bool with_reduce(const std::string& name, F&& f) {
    namespace reduce = lockstep::reduce;
    if (name == "per_tensor")
        return f(std::type_identity<reduce::per_tensor>{}), true;
    if (name == "bucketed")
        return f(std::type_identity<reduce::bucketed<>>{}), true;
    if (name == "ps")
        return f(std::type_identity<reduce::parameter_server<0>>{}), true;
    if (name == "bf16")
        return f(std::type_identity<reduce::compressed<lockstep::bfloat16>>{}), true;
    if (name == "fp16")
        return f(std::type_identity<reduce::compressed<lockstep::half>>{}), true;
    if (name == "reproducible")
        return f(std::type_identity<reduce::reproducible<repro_chunk>>{}), true;
    return false;
}

/// The --bn name of each BN policy.
template <class B>
inline constexpr std::string_view bn_name = "";
template <>
inline constexpr std::string_view bn_name<lockstep::bn::local> = "local";
template <>
inline constexpr std::string_view bn_name<lockstep::bn::global> = "global";
template <>
inline constexpr std::string_view bn_name<lockstep::bn::group<2>> = "group2";
template <>
inline constexpr std::string_view bn_name<lockstep::bn::running_only> = "running_only";
template <>
inline constexpr std::string_view bn_name<lockstep::bn::tower<0>> = "tower0";
template <>
inline constexpr std::string_view bn_name<lockstep::bn::ghost<repro_chunk>> = "ghost";

/// Calls f(type_identity<B>) for the B among BNs named `name`; false when none is.
template <class... BNs, class F>
bool with_bn_among(const std::string& name, F&& f) {
    return ((name == bn_name<BNs> ? (f(std::type_identity<BNs>{}), true) : false) || ...);
}

/// True for the --reduce and --optim names the program knows.
inline bool known_reduce(const std::string& name) {
    return with_reduce(name, [](auto) {});
}
inline bool known_optimizer(const std::string& name) {
    return with_optimizer(name, [](auto) {});
}

/// True for the --bn names the program knows.
inline bool known_bn(const std::string& name) {
    namespace bn = lockstep::bn;
    return with_bn_among<bn::local, bn::global, bn::group<2>, bn::running_only, bn::tower<0>,
                         bn::ghost<repro_chunk>>(name, [](auto) {});
}

/// lockstep's rules (policy/compat.hpp) on reduce::reproducible and bn::ghost for (Sync, R, B),
/// in its order and with its reasons: "" when they hold.
template <class Sync, class R, class B>
std::string reproducible_reason() {
    constexpr bool reproducible = R::chunk_samples > 0;
    constexpr bool ghost = lockstep::bn::is_ghost<B>;
    constexpr bool synchronous =
        !lockstep::is_asynchronous_v<Sync> && !lockstep::is_local_sgd_v<Sync>;
    if (reproducible && !synchronous)
        return "reduce::reproducible makes the weights independent of the replica count by "
               "summing every chunk's gradient exactly before one update; asynchronous workers "
               "and local SGD apply updates that depend on the replica count: use --reduce "
               "reproducible with --sync sync";
    if (reproducible && !ghost)
        return "reduce::reproducible needs every batch-norm layer to normalize each chunk on its "
               "own: bn::global, bn::group, bn::local, bn::running_only and bn::tower depend on "
               "how samples are split over replicas: use --bn ghost with --reduce reproducible";
    if (ghost && !reproducible)
        return "bn::ghost normalizes the chunks that reduce::reproducible cuts and gathers their "
               "statistics at the end of its step: use it with --reduce reproducible and --sync "
               "sync "
               "(or another --bn)";
    return {};
}

/// True when (Sync, R, B) satisfies lockstep's reduce::reproducible and bn::ghost rules.
template <class Sync, class R, class B>
inline constexpr bool reproducible_valid = (R::chunk_samples > 0) == lockstep::bn::is_ghost<B> &&
                                           (R::chunk_samples == 0 ||
                                            (!lockstep::is_asynchronous_v<Sync> &&
                                             !lockstep::is_local_sgd_v<Sync>));

/// Runs the combination (Sync, --reduce, --optim, --bn among BNs) when valid(reduce, bn) is
/// std::true_type; otherwise explains why not in `why` (what the library's static_assert says).
template <class Sync, class... BNs, class Comm, class Valid>
bool dispatch(Comm& comm, const options& o, const split_data& d, result& r, std::string& why,
              Valid valid) {
    bool ran = false;
    const bool known = with_reduce(o.reduce, [&](auto rt) {
        using R = typename decltype(rt)::type;
        const bool k = with_optimizer(o.optim, [&](auto ot) {
            using O = typename decltype(ot)::type;
            const bool kb = with_bn_among<BNs...>(o.bn, [&](auto bt) {
                using B = typename decltype(bt)::type;
                if constexpr (decltype(valid(rt, bt))::value) {
                    r = train_and_evaluate<Sync, R, O, B>(comm, o, d);
                    ran = true;
                } else {
                    why = valid.reason(rt, bt);
                }
            });
            if (!kb)
                why = "unknown --bn " + o.bn;
        });
        if (!k)
            why = "unknown --optim " + o.optim;
    });
    if (!known)
        why = "unknown --reduce " + o.reduce;
    return ran;
}

/// Synchronous training: every combination is valid except what the reduce::reproducible and
/// bn::ghost rules reject (each needs the other).
struct synchronous_valid {
    template <class R, class B>
    auto operator()(std::type_identity<R>, std::type_identity<B>) const {
        return std::bool_constant<reproducible_valid<lockstep::sync::synchronous, R, B>>{};
    }
    template <class R, class B>
    std::string reason(std::type_identity<R>, std::type_identity<B>) const {
        return reproducible_reason<lockstep::sync::synchronous, R, B>();
    }
};

/// dispatch over every --bn name (the invalid ones only produce their reason).
template <class Sync, class Comm, class Valid>
bool dispatch_all_bn(Comm& comm, const options& o, const split_data& d, result& r, std::string& why,
                     Valid valid) {
    namespace bn = lockstep::bn;
    return dispatch<Sync, bn::local, bn::global, bn::group<2>, bn::running_only, bn::tower<0>,
                    bn::ghost<repro_chunk>>(comm, o, d, r, why, valid);
}

} // namespace digits
