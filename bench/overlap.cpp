// bench_overlap: a network with ResNet-50's 161 parameter tensors and calibrated per-layer backward
// compute, trained with bucketed reduction over a simulated 10 Gb/s link, the thread group and MPI,
// with communication overlap on and off, beside compute alone and reduction alone (and PyTorch DDP
// on gloo running the same network). SPDX-License-Identifier: Apache-2.0
//
//     bench_overlap [--quick] [--reps N] [--gbps G] [--latency-us L] [--no-ddp] [--csv F]
//     mpiexec -n 2 bench_overlap_mpi [--quick] [--reps N] [--gbps G] [--latency-us L] [--csv F]
//
// Every row times, round-robin over repetitions (the median is printed), each fenced by barriers:
// - compute: one trainer step of the same network on a one-replica group whose collectives cost
//   nothing (solo_communicator), on every replica at once: backward, gradient zeroing, the
//   non-finite check, the SGD update, no reduction;
// - all_reduce: the trainer's gradient buckets all_reduced alone, in its order;
// - step: the data_parallel step with train_params::overlap never and always;
// - verify: the step with train_params::verify_every = 1 (overlap never) minus the step without,
//   the cost of one cross-replica consistency check (printed as a share of step time at 100);
// - reproducible (thread group and MPI: communicators with all_to_all): the same network and
//   backward trained with reduce::reproducible<1> (one chunk of one sample per replica; no
//   overlap: the exchange needs every chunk's gradient), beside the bucketed step (never).
// The backward runs from the last tensor to the first; per tensor it burns a share of the
// calibrated backward time proportional to ResNet-50's backward cost (weights x output pixels,
// resnet50_output_pixels), writes the gradient and calls ctx.mark_ready. The backward is
// calibrated to take as long as the reduction: the modelled wire time on the simulated link,
// the measured all_reduce time on the thread group and MPI.
// --csv F: the table's rows (one per backend, replica count and overlap mode) as CSV.
#include "csv.hpp"
#include "lockstep/comm/simulated_link.hpp"
#include "lockstep/comm/thread_group.hpp"
#include "lockstep/optim/sgd.hpp"
#include "lockstep/train/data_parallel.hpp"
#include "median.hpp"
#include "resnet50.hpp"
#include "resnet_shaped.hpp"
#if LOCKSTEP_BENCH_MPI
#include "lockstep/comm/mpi_communicator.hpp"
#include "lockstep/comm/mpi_environment.hpp"
#endif

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <unistd.h>
#include <vector>

using namespace lockstep;
using bench_nets::resnet_shaped;
using bench_nets::workload;
using steady = std::chrono::steady_clock;

namespace {

struct options {
    bool quick = false;
    int reps = 10;
    double gbps = 10;
    double latency_us = 20;
    bool ddp = true;
    std::string csv; ///< --csv: the CSV file ("" for none)
};

/// A group of one replica with no communication cost: the "compute" rows train on it, so they
/// time everything a step does except reducing (in-place collectives return at once).
class solo_communicator {
public:
    using system_type = host_system;
    explicit solo_communicator(host_system sys) : sys_(sys) {}
    host_system system() const { return sys_; }
    int rank() const { return 0; }
    int size() const { return 1; }
    template <class T>
    void all_reduce(std::span<const std::type_identity_t<T>> send, std::span<T> recv, reduce_op) {
        if (send.data() != recv.data())
            std::copy(send.begin(), send.end(), recv.begin());
    }
    template <class T>
    void reduce(std::span<const std::type_identity_t<T>> send, std::span<T> recv, reduce_op op,
                int) {
        all_reduce(send, recv, op);
    }
    template <class T>
    void all_gather(std::span<const std::type_identity_t<T>> send, std::span<T> recv) {
        all_reduce(send, recv, reduce_op::sum);
    }
    template <class T>
    void reduce_scatter(std::span<const std::type_identity_t<T>> send, std::span<T> recv,
                        std::span<const std::size_t>, reduce_op op) {
        all_reduce(send, recv, op);
    }
    template <class T>
    void reduce_scatter(std::span<const std::type_identity_t<T>> send, std::span<T> recv,
                        reduce_op op) {
        all_reduce(send, recv, op);
    }
    template <class T>
    void broadcast(std::span<T>, int) {}
    void barrier() {}
    solo_communicator split(int, int) { return *this; }

private:
    host_system sys_;
};
static_assert(communicator<solo_communicator>);

/// 8 MiB buckets (reduce::bucketed's default is 25 MiB, as DDP's): at 10 Gb/s one bucket's wire
/// time is about 6.7 ms, so the link follows the backward closely (docs/overlap.md has both).
constexpr int bucket_mib = 8;
using bucket_policy = reduce::bucketed<std::size_t{bucket_mib} << 20>;

template <class Comm>
using trainer_for = data_parallel<resnet_shaped<replica_context<float, Comm>>, optim::sgd<float>,
                                  sync::synchronous, bucket_policy, Comm>;

/// The same network trained with reduce::reproducible<1>: one chunk of one sample per replica.
template <class Comm>
using reproducible_for =
    data_parallel<resnet_shaped<replica_context<float, Comm>>, optim::sgd<float>, sync::synchronous,
                  reduce::reproducible<1>, Comm>;

template <class Trainer>
void train_step(Trainer& tr) {
    tr.step(static_cast<std::size_t>(tr.size()), [](auto& net, const shard_range&, auto& ctx) {
        net.backward(ctx);
        return 0.0;
    });
}

/// What one configuration measured (medians, ms).
struct row {
    std::string backend;
    int replicas = 0;
    double target_ms = 0;  ///< the backward the compute was calibrated to
    double compute_ms = 0; ///< a step without reduction
    double all_reduce_ms = 0;
    double model_ms = -1; ///< the simulated link's modelled wire time (-1: not simulated)
    /// The simulated link's carriage: the buckets all_reduced alone over the wrapped communicator
    /// (no wire time), memory work on the compute cores (-1: not simulated).
    double carriage_ms = -1;
    double never_ms = 0;
    double always_ms = 0;
    /// train_params::verify_every = 1's check: the step with it minus the step without (both
    /// overlap never), per repetition, median (-1: not measured).
    double verify_ms = -1;
    bool always_overlaps = false;    ///< overlap_mode::always got a communication stream
    bool automatic_overlaps = false; ///< what overlap_mode::automatic chooses here
    /// overlap_mode::always's communication thread runs at background priority
    bool background = false;
    std::size_t buckets = 0;
    bool ddp = false;            ///< torch DDP's row: one step, overlapped as DDP does
    double reproducible_ms = -1; ///< reduce::reproducible<1>'s step (-1: not measured)
};

using bench_stats::median;

/// Runs one configuration on this replica. comm: the communicator trained over; fence(): a
/// barrier that costs no modelled wire time; model(bytes): the modelled wire time of one
/// all_reduce in ms (or a negative number: calibrate to the measured all_reduce).
template <class Comm, class Fence, class Model>
row run_config(Comm& comm, Fence fence, Model model, const options& opt, std::string backend) {
    const int me = comm.rank();
    auto work = std::make_unique<workload>();
    const auto timed = [&](auto&& f) {
        fence();
        const auto t0 = steady::now();
        f();
        fence();
        return std::chrono::duration<double, std::milli>(steady::now() - t0).count();
    };
    solo_communicator solo_comm(comm.system());
    using full_t = trainer_for<Comm>;
    using solo_t = trainer_for<decltype(solo_comm)>;
    const auto factory = [&](auto& ctx) {
        return resnet_shaped<std::remove_reference_t<decltype(ctx)>>(ctx, *work);
    };
    const optim::sgd_params sgd{.lr = 1e-3, .momentum = 0.9};
    full_t never(comm, factory, sgd, train_params{.overlap = overlap_mode::never});
    full_t always(comm, factory, sgd, train_params{.overlap = overlap_mode::always});
    const bool automatic = detail::use_overlap(comm, overlap_mode::automatic).enabled;
    const bool background =
        detail::use_overlap(comm, overlap_mode::always).priority == comm_priority::background;
    solo_t solo(solo_comm, factory, sgd, train_params{.overlap = overlap_mode::never});
    full_t verified(comm, factory, sgd,
                    train_params{.overlap = overlap_mode::never, .verify_every = 1});
    auto reproducible = [&] {
        if constexpr (all_to_all_communicator<Comm>)
            return std::make_unique<reproducible_for<Comm>>(comm, factory, sgd, train_params{});
        else
            return 0;
    }();

    // The reduction alone: the trainer's buckets, in its order, over a gradient-sized buffer.
    std::vector<float> grads(work->floats(), 1e-4f);
    const auto reduce_buckets = [&](auto& over) {
        for (const auto& b : never.buckets()) {
            std::span<float> piece(grads.data() + b.offset, b.size);
            over.all_reduce(std::span<const float>(piece), piece, reduce_op::sum);
        }
    };
    const auto reduce_alone = [&] { reduce_buckets(comm); };
    double model_ms = 0;
    for (const auto& b : never.buckets())
        model_ms += model(b.size * sizeof(float));

    // Calibration: the burn rate with every replica burning, then the backward's target.
    std::vector<double> warm;
    for (int k = 0; k < (opt.quick ? 2 : 4); ++k)
        warm.push_back(timed(reduce_alone));
    const double target_ms = model_ms >= 0 ? model_ms : median(warm);
    fence();
    const std::size_t chunk = std::size_t{1} << 20;
    std::size_t burned = 0;
    const auto c0 = steady::now();
    while (steady::now() - c0 < std::chrono::milliseconds(opt.quick ? 100 : 300)) {
        work->burn.run(chunk);
        burned += chunk;
    }
    double rate[1] = {static_cast<double>(burned) /
                      std::chrono::duration<double>(steady::now() - c0).count()};
    comm.all_reduce(std::span<const double>(rate), std::span<double>(rate), reduce_op::sum);
    rate[0] /= comm.size();
    work->set_total(rate[0] * target_ms * 1e-3);
    // One correction: time the backward alone (every replica at once) and rescale.
    auto& solo_net = solo.network();
    auto& solo_ctx = solo.context();
    const double first = timed([&] { solo_net.backward(solo_ctx); });
    work->set_total(rate[0] * target_ms * 1e-3 * (target_ms / first));

    // The simulated link's carriage alone: its wrapped communicator, no wire time.
    const auto carriage_alone = [&] {
        if constexpr (requires { comm.inner(); })
            reduce_buckets(comm.inner());
    };
    std::vector<double> compute, reduce, carriage, step_never, step_always, verify, repro;
    const int reps = opt.quick ? 3 : opt.reps;
    for (int rep = 0; rep <= reps; ++rep) { // round-robin; repetition 0 warms up
        const double c = timed([&] { train_step(solo); });
        const double r = timed(reduce_alone);
        const double k = timed(carriage_alone);
        const double n = timed([&] { train_step(never); });
        const double a = timed([&] { train_step(always); });
        const double v = timed([&] { train_step(verified); });
        double p = -1;
        if constexpr (all_to_all_communicator<Comm>)
            p = timed([&] { train_step(*reproducible); });
        if (rep == 0)
            continue;
        repro.push_back(p);
        verify.push_back(v - n);
        compute.push_back(c);
        reduce.push_back(r);
        carriage.push_back(k);
        step_never.push_back(n);
        step_always.push_back(a);
    }
    row out;
    out.backend = std::move(backend);
    out.replicas = comm.size();
    out.target_ms = target_ms;
    out.compute_ms = median(compute);
    out.all_reduce_ms = median(reduce);
    out.model_ms = model_ms >= 0 ? model_ms : -1;
    out.carriage_ms = model_ms >= 0 ? median(carriage) : -1;
    out.never_ms = median(step_never);
    out.always_ms = median(step_always);
    out.verify_ms = median(verify);
    out.reproducible_ms = median(repro);
    out.always_overlaps = always.overlaps();
    out.automatic_overlaps = automatic;
    out.background = background;
    out.buckets = never.buckets().size();
    if (me == 0) {
        std::string sizes;
        for (const auto& b : never.buckets()) {
            char mb[16];
            std::snprintf(mb, sizeof mb, "%s%.1f", sizes.empty() ? "" : " ", b.size * 4e-6);
            sizes += mb;
        }
        std::printf("  %-34s %d replicas: backward calibrated to %.1f ms (%.3g floats burned, "
                    "%.2f G/s per replica); buckets in launch order (MB): %s",
                    out.backend.c_str(), out.replicas, target_ms,
                    rate[0] * target_ms * 1e-3 * (target_ms / first), rate[0] * 1e-9,
                    sizes.c_str());
        if (model_ms >= 0)
            std::printf("; the last one's wire time %.1f ms",
                        model(never.buckets().back().size * sizeof(float)));
        std::printf("\n");
    }
    std::fflush(stdout);
    return out;
}

/// What a step that hides the wire completely still costs on cores that also carry the data:
/// (compute + carriage) / max(compute, wire). -1 off the simulated link.
double floor_over_max(const row& r) {
    if (r.carriage_ms < 0)
        return -1;
    return (r.compute_ms + r.carriage_ms) / std::max(r.compute_ms, r.model_ms);
}

void print_header() {
    std::printf("\n%-34s %3s %-7s %9s %9s %9s %9s %10s %10s\n", "backend", "n", "overlap",
                "compute", "reduce", "wire", "step", "step/max", "step/sum");
    std::printf("%-34s %3s %-7s %9s %9s %9s %9s %10s %10s\n", "", "", "", "ms", "ms", "model ms",
                "ms", "(c, wire)", "(c + red)");
}

void print_row(const row& r, const char* mode, double step) {
    const double wire = r.model_ms >= 0 ? r.model_ms : r.all_reduce_ms;
    char model[32] = "-";
    if (r.model_ms >= 0)
        std::snprintf(model, sizeof model, "%.1f", r.model_ms);
    std::printf("%-34s %3d %-7s %9.1f %9.1f %9s %9.1f %10.3f %10.3f\n", r.backend.c_str(),
                r.replicas, mode, r.compute_ms, r.all_reduce_ms, model, step,
                step / std::max(r.compute_ms, wire), step / (r.compute_ms + r.all_reduce_ms));
}

void print_rows(const std::vector<row>& rows) {
    print_header();
    for (const row& r : rows) {
        if (r.ddp) {
            print_row(r, "DDP", r.always_ms);
            continue;
        }
        print_row(r, "never", r.never_ms);
        print_row(r, r.always_overlaps ? "always" : "always*", r.always_ms);
    }
    for (const row& r : rows)
        if (r.verify_ms > -1 && !r.ddp)
            std::printf("consistency check, %s, %d replicas: verify_every = 1 adds %.2f ms to a "
                        "%.1f ms step (overlap never); at verify_every = 100: %.3f%% of step "
                        "time\n",
                        r.backend.c_str(), r.replicas, r.verify_ms, r.never_ms,
                        100.0 * r.verify_ms / 100.0 / r.never_ms);
    for (const row& r : rows)
        if (r.reproducible_ms > 0)
            std::printf("reproducible, %s, %d replicas: reduce::reproducible<1> step %.1f ms = "
                        "%.3f x the bucketed step (overlap never, %.1f ms)\n",
                        r.backend.c_str(), r.replicas, r.reproducible_ms,
                        r.reproducible_ms / r.never_ms, r.never_ms);
    for (const row& r : rows)
        if (r.carriage_ms >= 0)
            std::printf("floor, %s, %d replicas: compute + carriage (the wrapped communicator's "
                        "all_reduce alone, %.1f ms, memory work on the same cores) = %.1f ms = "
                        "%.3f x max(compute, wire); overlap always = %.3f x that floor\n",
                        r.backend.c_str(), r.replicas, r.carriage_ms, r.compute_ms + r.carriage_ms,
                        floor_over_max(r), r.always_ms / (r.compute_ms + r.carriage_ms));
    for (const row& r : rows)
        if (r.model_ms > 0)
            std::printf("wire model, %s, %d replicas: reduction alone %.1f ms / modelled %.1f ms "
                        "= %.3f\n",
                        r.backend.c_str(), r.replicas, r.all_reduce_ms, r.model_ms,
                        r.all_reduce_ms / r.model_ms);
    for (const row& r : rows)
        if (!r.ddp && !r.always_overlaps)
            std::printf("* %s: overlap_mode::always fell back to inline reduction (MPI without "
                        "MPI_THREAD_MULTIPLE)\n",
                        r.backend.c_str());
    for (const row& r : rows)
        if (!r.ddp)
            std::printf("overlap_mode::automatic, %s, %d replicas: %s; always's communication "
                        "thread: %s priority\n",
                        r.backend.c_str(), r.replicas, r.automatic_overlaps ? "always" : "never",
                        r.background ? "background" : "normal");
}

/// The table's rows as CSV (nothing when path is empty); wire_model_ms is empty off the
/// simulated link.
void write_csv(const std::vector<row>& rows, const std::string& path) {
    bench_csv::writer csv(path, {"bench", "backend", "replicas", "mode", "compute_ms", "reduce_ms",
                                 "wire_model_ms", "step_ms", "step_over_max", "step_over_sum",
                                 "carriage_ms", "floor_over_max"});
    const auto add = [&](const row& r, const char* mode, double step) {
        const double wire = r.model_ms >= 0 ? r.model_ms : r.all_reduce_ms;
        csv.row({"overlap", r.backend, r.replicas, mode, r.compute_ms, r.all_reduce_ms,
                 r.model_ms >= 0 ? bench_csv::cell(r.model_ms) : bench_csv::cell(""), step,
                 step / std::max(r.compute_ms, wire), step / (r.compute_ms + r.all_reduce_ms),
                 r.carriage_ms >= 0 ? bench_csv::cell(r.carriage_ms) : bench_csv::cell(""),
                 r.carriage_ms >= 0 ? bench_csv::cell(floor_over_max(r)) : bench_csv::cell("")});
    };
    for (const row& r : rows) {
        if (r.ddp) {
            add(r, "ddp", r.always_ms);
            continue;
        }
        add(r, "never", r.never_ms);
        add(r, r.always_overlaps ? "always" : "always_inline", r.always_ms);
        if (r.reproducible_ms > 0)
            add(r, "reproducible", r.reproducible_ms);
    }
}

void print_machine(const options& opt) {
    double load[3] = {0, 0, 0};
    if (FILE* f = std::fopen("/proc/loadavg", "r")) {
        if (std::fscanf(f, "%lf %lf %lf", &load[0], &load[1], &load[2]) != 3)
            load[0] = load[1] = load[2] = -1;
        std::fclose(f);
    }
    std::printf("bench_overlap: ResNet-50's 161 tensors (%.1f MB of float gradients), "
                "reduce::bucketed<%d MiB>, SGD momentum 0.9, %d repetitions (median), %u hardware "
                "threads, load average %.2f %.2f %.2f%s\n",
                bench_nets::resnet50_tensors().back().offset * 4e-6 + 4e-3, bucket_mib,
                opt.quick ? 3 : opt.reps, std::thread::hardware_concurrency(), load[0], load[1],
                load[2],
                load[0] > 1.5 ? " (busy machine: numbers are not quiet-machine numbers)" : "");
}

options parse(int argc, char** argv) {
    options o;
    for (int i = 1; i < argc; ++i) {
        const std::string a = argv[i];
        const auto next = [&] {
            if (i + 1 >= argc) {
                std::fprintf(stderr, "%s needs a value\n", a.c_str());
                std::exit(2);
            }
            return std::atof(argv[++i]);
        };
        if (a == "--quick")
            o.quick = true;
        else if (a == "--reps")
            o.reps = std::max(1, static_cast<int>(next()));
        else if (a == "--gbps")
            o.gbps = next();
        else if (a == "--latency-us")
            o.latency_us = next();
        else if (a == "--no-ddp")
            o.ddp = false;
        else if (a == "--csv" && i + 1 < argc)
            o.csv = argv[++i];
        else {
            std::fprintf(stderr,
                         "usage: %s [--quick] [--reps N] [--gbps G] [--latency-us L] [--no-ddp] "
                         "[--csv F]\n",
                         argv[0]);
            std::exit(2);
        }
    }
    return o;
}

simulated_link_params link_params(const options& o) {
    return {.latency = std::chrono::microseconds(static_cast<long>(o.latency_us)),
            .bandwidth = o.gbps * 1e9 / 8};
}

std::string link_name(const options& o, const char* over) {
    char s[64];
    std::snprintf(s, sizeof s, "simulated %g Gb/s over %s", o.gbps, over);
    return s;
}

#if !LOCKSTEP_BENCH_MPI
/// Runs bench/torch_ddp_overlap.py (system python with torch) on the same network with the same
/// per-tensor backward time; returns its output line, or why it did not run.
std::string run_ddp(const workload& w, double target_ms, const options& opt) {
    const char* python = access("/usr/bin/python3", X_OK) == 0 ? "/usr/bin/python3" : "python3";
    const std::string probe = std::string(python) + " -c 'import torch.distributed' 2>/dev/null";
    if (std::system(probe.c_str()) != 0)
        return "skipped: python3 with torch not found (bash scripts/deps --bench installs it)";
    const std::string layers = "/tmp/lockstep_overlap_layers_" + std::to_string(getpid()) + ".csv";
    {
        std::ofstream f(layers);
        for (std::size_t t = 0; t < w.tensors.size(); ++t) {
            f << w.tensors[t].name << ',' << w.share[t];
            for (auto e : w.tensors[t].shape)
                f << ',' << e;
            f << '\n';
        }
    }
    char cmd[1024];
    std::snprintf(cmd, sizeof cmd,
                  "timeout -k 10 %d %s '%s/torch_ddp_overlap.py' --layers '%s' --backward-ms %.3f "
                  "--reps %d --timeout %d --bucket-mb %d 2>&1",
                  opt.quick ? 240 : 600, python, LOCKSTEP_BENCH_DIR, layers.c_str(), target_ms,
                  opt.quick ? 3 : opt.reps, opt.quick ? 120 : 300, bucket_mib);
    std::string out, line;
    if (FILE* p = popen(cmd, "r")) {
        char buf[4096];
        while (std::fgets(buf, sizeof buf, p)) {
            const std::string l = buf;
            if (l.rfind("torch_ddp ", 0) == 0)
                line = l;
            out += l;
        }
        const int status = pclose(p);
        if (status != 0 && line.empty())
            line = "failed (exit status " + std::to_string(status) + "):\n" + out;
    }
    std::remove(layers.c_str());
    return line.empty() ? "failed:\n" + out : line;
}

/// The table row of torch_ddp_overlap.py's output line (its "overlap" is DDP's own).
std::optional<row> ddp_row(const std::string& line) {
    const auto value = [&](const char* key) {
        const std::string k = std::string(" ") + key + "=";
        const auto at = line.find(k);
        return at == std::string::npos ? -1.0 : std::atof(line.c_str() + at + k.size());
    };
    if (line.rfind("torch_ddp ", 0) != 0 || value("step_ms") <= 0)
        return std::nullopt;
    row r;
    r.backend = "torch DDP, gloo";
    r.replicas = static_cast<int>(value("procs"));
    r.target_ms = value("backward_target_ms");
    r.compute_ms = value("compute_ms");
    r.all_reduce_ms = value("allreduce_ms");
    r.never_ms = -1;
    r.always_ms = value("step_ms");
    r.always_overlaps = true;
    r.ddp = true;
    return r;
}
#endif

} // namespace

int main(int argc, char** argv) {
#if LOCKSTEP_BENCH_MPI
    // The communication thread calls MPI while the compute thread may: MPI_THREAD_MULTIPLE.
    mpi_environment env(argc, argv, {.requested = MPI_THREAD_MULTIPLE});
    const options opt = parse(argc, argv);
    mpi_communicator comm(MPI_COMM_WORLD);
    if (comm.rank() == 0)
        print_machine(opt);
    std::vector<row> rows;
    const auto no_model = [](std::size_t) { return -1.0; };
    rows.push_back(run_config(
        comm, [&] { comm.barrier(); }, no_model, opt, "mpi"));
    {
        simulated_link<mpi_communicator> link(comm, link_params(opt));
        const auto model = [&](std::size_t bytes) {
            return std::chrono::duration<double, std::milli>(
                       link_wire_time(link.parameters(), link_op::all_reduce, bytes, comm.size()))
                .count();
        };
        rows.push_back(run_config(
            link, [&] { comm.barrier(); }, model, opt, link_name(opt, "mpi")));
    }
    if (comm.rank() == 0) {
        print_rows(rows);
        write_csv(rows, opt.csv);
    }
#else
    const options opt = parse(argc, argv);
    print_machine(opt);
    std::vector<row> rows;
    for (const int n : {2, 4}) {
        thread_group(n).run([&](thread_communicator& comm) {
            simulated_link<thread_communicator> link(comm, link_params(opt));
            const auto model = [&](std::size_t bytes) {
                return std::chrono::duration<double, std::milli>(
                           link_wire_time(link.parameters(), link_op::all_reduce, bytes, n))
                    .count();
            };
            row r = run_config(
                link, [&] { comm.barrier(); }, model, opt, link_name(opt, "thread_group"));
            if (comm.rank() == 0)
                rows.push_back(r);
        });
    }
    double thread_target = 0;
    thread_group(2).run([&](thread_communicator& comm) {
        row r = run_config(
            comm, [&] { comm.barrier(); }, [](std::size_t) { return -1.0; }, opt, "thread_group");
        if (comm.rank() == 0) {
            thread_target = r.target_ms;
            rows.push_back(r);
        }
    });
    std::string ddp = "not run (--no-ddp)";
    if (opt.ddp) {
        std::printf("  torch DDP (gloo, 2 processes x 1 thread, 127.0.0.1): the same network, "
                    "backward calibrated to the thread_group row's %.1f ms\n",
                    thread_target);
        std::fflush(stdout);
        const workload w;
        ddp = run_ddp(w, thread_target, opt);
        if (auto r = ddp_row(ddp))
            rows.push_back(*r);
    }
    print_rows(rows);
    write_csv(rows, opt.csv);
    std::printf("torch DDP: %s\n", ddp.c_str());
#endif
}
