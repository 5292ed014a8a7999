// examples/digits/digits.cpp: lockstep's main demo: trains a user-written MLP with batch norm and
// dropout on the 8x8 digits data over N replicas, with the policies chosen on the command line.
// SPDX-License-Identifier: Apache-2.0
#include "digits_comm.hpp"
#include "digits_run.hpp"

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <string_view>

#ifndef LOCKSTEP_DIGITS_CSV
#define LOCKSTEP_DIGITS_CSV "data/digits.csv.gz"
#endif

namespace {

#if DIGITS_WITH_MPI
#define DIGITS_MPI_HELP                                                                            \
    "  --mpi            one replica per MPI process instead (run under mpiexec -n N)\n"
#else
#define DIGITS_MPI_HELP                                                                            \
    "  --mpi            (not in this build: no MPI) one replica per MPI process\n"
#endif

void usage(const char* argv0) {
    std::printf(
        "usage: %s [options]\n"
        "  --replicas N     replicas (threads of this process; default 4)\n" DIGITS_MPI_HELP
        "  --epochs E       passes over the training set (default 20)\n"
        "  --batch B        global batch size (default 64; async: B / workers per worker)\n"
        "  --lr X           learning rate (default: per optimizer)\n"
        "  --seed S         seed of data order, dropout and initialisation (default 1)\n"
        "  --sync P         sync | async | stale:S (S = 1, 4) | local:K (K = 4, 16)\n"
        "  --reduce R       per_tensor | bucketed | ps | bf16 | fp16 | reproducible (default\n"
        "                   bucketed; reproducible: chunks of 16 samples summed exactly, the\n"
        "                   same weights for every replica count; needs --bn ghost, --sync sync)\n"
        "  --optim O        sgd | adam | adamw | lars | lamb (default sgd)\n"
        "  --bn B           local | global | group2 | running_only | tower0 | ghost (default\n"
        "                   local; ghost: each 16-sample chunk normalized on its own, with\n"
        "                   --reduce reproducible)\n"
        "  --hidden H       hidden units (default 128)\n"
        "  --dropout P      dropout probability (default 0.1)\n"
        "  --data FILE      digits CSV, gzipped or plain (default: the bundled copy)\n"
        "  --quiet          no progress bar\n"
        "  --save PATH      write a checkpoint after the last step (sync, local:K)\n"
        "  --resume PATH    continue from a checkpoint (same options as the run that saved it;\n"
        "                   --replicas may differ with --sync sync)\n"
        "  --steps N        stop after N steps in total (an interruption to resume from;\n"
        "                   with --resume at least the checkpoint's step)\n"
        "  --checkpoint PATH  resume from PATH when it exists, save to it after the last step\n"
        "                   (a job that tools/lockstep-run relaunches continues where it was)\n"
        "  --checkpoint-every K  also save to --checkpoint before every K-th step\n"
        "  --checkpoint-async  those saves in the background (--sync sync; the final save\n"
        "                   still blocks)\n"
        "  --kill-at S:R    fault injection: replica R SIGKILLs itself before step S in the\n"
        "                   first launch of a job (LOCKSTEP_RUN_ATTEMPT unset or 0)\n"
        "  --stall-at S:R   the same, but replica R stops responding (sleeps for 10 minutes)\n"
        "  --lose-at S:R    threads: replica R's thread ends before step S (a lost replica)\n"
        "  --shrink         threads, --sync sync: continue on the survivors when a replica is\n"
        "                   lost (train_params::on_replica_failure = shrink)\n",
        argv0);
}

[[noreturn]] void bad(const std::string& msg) {
    std::fprintf(stderr, "digits: %s (see --help)\n", msg.c_str());
    std::exit(2);
}

digits::options parse(int argc, char** argv) {
    digits::options o;
    o.data = LOCKSTEP_DIGITS_CSV;
    for (int i = 1; i < argc; ++i) {
        const std::string_view a = argv[i];
        auto value = [&]() -> std::string {
            if (i + 1 >= argc)
                bad(std::string(a) + " needs a value");
            return argv[++i];
        };
        auto number = [&](double lo) {
            const std::string v = value();
            char* end = nullptr;
            const double x = std::strtod(v.c_str(), &end);
            if (end == v.c_str() || *end != '\0' || !(x >= lo))
                bad(std::string(a) + " " + v + ": expected a number >= " + std::to_string(lo));
            return x;
        };
        if (a == "--help" || a == "-h") {
            usage(argv[0]);
            std::exit(0);
        } else if (a == "--replicas")
            o.replicas = int(number(1));
        else if (a == "--mpi")
            o.mpi = true;
        else if (a == "--epochs")
            o.epochs = int(number(1));
        else if (a == "--batch")
            o.batch = std::size_t(number(1));
        else if (a == "--lr")
            o.lr = number(0);
        else if (a == "--seed")
            o.seed = std::uint64_t(number(0));
        else if (a == "--sync")
            o.sync = value();
        else if (a == "--reduce")
            o.reduce = value();
        else if (a == "--optim")
            o.optim = value();
        else if (a == "--bn")
            o.bn = value();
        else if (a == "--hidden")
            o.hidden = int(number(1));
        else if (a == "--dropout") {
            o.dropout = float(number(0));
            if (o.dropout >= 1)
                bad("--dropout must be < 1");
        } else if (a == "--data")
            o.data = value();
        else if (a == "--quiet")
            o.progress = false;
        else if (a == "--save")
            o.save = value();
        else if (a == "--resume")
            o.resume = value();
        else if (a == "--steps")
            o.steps = std::size_t(number(1));
        else if (a == "--checkpoint")
            o.checkpoint = value();
        else if (a == "--checkpoint-every")
            o.checkpoint_every = std::size_t(number(1));
        else if (a == "--checkpoint-async")
            o.checkpoint_async = true;
        else if (a == "--shrink")
            o.shrink = true;
        else if (a == "--lose-at") {
            const std::string v = value();
            unsigned long step = 0;
            int rank = -1, used = 0;
            if (std::sscanf(v.c_str(), "%lu:%d%n", &step, &rank, &used) != 2 ||
                used != int(v.size()) || rank < 0)
                bad("--lose-at " + v + ": expected STEP:REPLICA");
            o.lose = {.step = step, .rank = rank};
        } else if (a == "--kill-at" || a == "--stall-at") {
            const std::string v = value();
            unsigned long step = 0;
            int rank = -1, used = 0;
            if (std::sscanf(v.c_str(), "%lu:%d%n", &step, &rank, &used) != 2 ||
                used != int(v.size()) || rank < 0)
                bad(std::string(a) + " " + v + ": expected STEP:RANK");
            o.fault = {.step = step, .rank = rank, .stall = a == "--stall-at"};
        } else
            bad("unknown option " + std::string(a));
    }
    const bool sync_ok = o.sync == "sync" || o.sync == "async" || o.sync.starts_with("stale:") ||
                         o.sync.starts_with("local:");
    if (!sync_ok)
        bad("unknown --sync " + o.sync);
    if (!digits::known_bn(o.bn))
        bad("unknown --bn " + o.bn);
    if (!digits::known_reduce(o.reduce))
        bad("unknown --reduce " + o.reduce);
    if (!digits::known_optimizer(o.optim))
        bad("unknown --optim " + o.optim);
    if (!o.checkpoint.empty() && (!o.save.empty() || !o.resume.empty()))
        bad("--checkpoint replaces --save and --resume: give one or the other");
    if (o.checkpoint_every > 0 && o.checkpoint.empty())
        bad("--checkpoint-every needs --checkpoint");
    if (o.checkpoint_async && (o.checkpoint_every == 0 || o.sync != "sync"))
        bad("--checkpoint-async needs --checkpoint-every and --sync sync");
    return o;
}

/// Runs the chosen combination on this replica; rank 0 prints the result.
template <class Comm>
void run(Comm& comm, const digits::options& o, const digits::split_data& data) {
    digits::result r;
    std::string why;
    bool ran = false;
    if (o.sync == "sync") {
        namespace bn = lockstep::bn;
        if (digits::with_bn_among<bn::running_only, bn::tower<0>>(o.bn, [](auto) {}))
            ran = digits::run_synchronous_shared_bn(comm, o, data, r, why);
        else
            ran = digits::run_synchronous_local_bn(comm, o, data, r, why);
    } else if (o.sync.starts_with("local:")) {
        ran = digits::run_local_sgd(comm, o, data, r, why);
    } else if (comm.size() < 2) {
        why = "asynchronous training needs a server and a worker: use --replicas 2 or more";
    } else {
        ran = digits::run_asynchronous(comm, o, data, r, why);
    }
    if (!ran)
        lockstep::fail(lockstep::errc::invalid_argument, comm.rank(), "digits", why);
    if (comm.rank() != 0)
        return;
    std::printf("digits: %d replicas (%s), sync %s, reduce %s, optim %s, bn %s, hidden %d, "
                "batch %zu, %d epochs\n",
                comm.size(), o.mpi ? "MPI processes" : "threads", o.sync.c_str(), o.reduce.c_str(),
                o.optim.c_str(), o.bn.c_str(), o.hidden, o.batch, o.epochs);
    if (!r.staleness.empty())
        std::printf("  staleness: %s\n", r.staleness.c_str());
    if (r.samples == 0) // resumed at the last step (--steps N from step N): no loss to print
        std::printf("  train: no step to run (resumed after step %zu)\n", r.steps);
    else
        std::printf("  train: %zu steps, %zu samples in %.3f s = %.0f samples/s, last loss %.4f\n",
                    r.steps, r.samples, r.seconds, r.samples_per_s, r.final_loss);
    std::printf("  test accuracy: %.2f %% (%zu samples)\n", 100.0 * r.accuracy, data.test.size());
    if (o.sync == "sync" || o.sync.starts_with("local:"))
        std::printf("  weights: FNV-1a %016llx after step %zu\n",
                    static_cast<unsigned long long>(r.weights_hash), r.steps);
}

} // namespace

int main(int argc, char** argv) {
    const digits::options o = parse(argc, argv);
    if (o.mpi && (o.shrink || o.lose.rank >= 0))
        bad("--shrink and --lose-at are for thread replicas (an MPI job that lost a rank is "
            "relaunched: tools/lockstep-run)");
    try {
        const digits::split_data data = digits::load(o.data);
        if (o.mpi) {
#if DIGITS_WITH_MPI
            lockstep::mpi_environment env(argc, argv);
            lockstep::mpi_communicator comm(MPI_COMM_WORLD);
            try {
                run(comm, o, data);
            } catch (const std::exception& e) {
                // peers may wait in a collective for this process; a lost peer's timeout ends the
                // job with status 75, which tools/lockstep-run relaunches
                comm.abort(e, lockstep::exit_status(e));
            }
            return 0;
#else
            bad("--mpi: this build has no MPI (install libmpich-dev and reconfigure with "
                "LOCKSTEP_DIGITS_MPI=ON)");
#endif
        }
        lockstep::thread_group group(o.replicas);
        group.run([&](lockstep::thread_communicator& comm) {
            try {
                run(comm, o, data);
            } catch (const digits::lost_thread&) {
                // this replica's thread ends here
            }
        });
        for (const lockstep::lost_replica& l : group.lost())
            std::printf("  lost replica %d: %s\n", l.replica, l.reason.c_str());
    } catch (const std::exception& e) {
        std::fprintf(stderr, "digits: %s\n", e.what());
        return 1;
    }
    return 0;
}
