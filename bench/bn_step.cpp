// bench_bn_step: training steps of a network made of ResNet-50's 53 batch-norm layers with
// bn::global (synchronized BN) beside the same layers with bn::local, on 2 thread replicas, or
// under `mpiexec -n 2` (bench_bn_step_mpi). SPDX-License-Identifier: Apache-2.0
//
//     bench_bn_step [--quick] [--reps N] [--batch B] [--side S] [--csv FILE]
//     OMP_NUM_THREADS=1 mpiexec -n 2 bench_bn_step_mpi [the same options]
//
// The network: torchvision ResNet-50's 53 BN layers (channels and feature-map sides at an S x S
// input, bench/resnet50.hpp; default S = 224, ImageNet's: 11.1 M values per sample; --side 112
// has a quarter of them), NCHW float, B samples per replica (default 2). The step function runs
// forward_train through the 53 layers in order, then backward from the last to the first, each
// layer on its own input (fixed values that differ per replica and layer; the output gradient is
// one shared buffer): BN alone, no convolution between, so the rows show BN's collectives
// against BN's own work. The MPI twin uses mpi_communicator's defaults (signature check on).
// It runs inside data_parallel's synchronous step (reduce::bucketed<>, SGD with momentum,
// overlap never), so both rows also pay the trainer's gradient reduction of gamma and beta.
// bn::global adds one all_gather (forward statistics) and one all_reduce (backward sums) per
// layer: 106 small collectives per step; bn::local none.
//
// Round-robin repetitions (a global and a local step, each between barriers, the order
// alternating), medians over repetitions:
// - step ms: one step, barrier to barrier (the slower replica);
// - collective ms: the time a replica spent inside the collectives issued by the step function
//   (BN's), summed from the communicator's flight recorder (each collective's start to end,
//   waiting for the peer included; the program sets LOCKSTEP_TRACE_OPS so a step's collectives
//   fit in it), mean over the replicas; the trainer's own collectives after the step function
//   are not counted;
// - last-arrival ms: per collective the shorter of the replicas' times (the replica that
//   arrived last), summed: the collectives' cost without the wait for a late arrival, which a
//   loaded machine inflates (a bn::local step absorbs such skew in its gradient reduction);
// - global - local: the step times' difference, paired per repetition.
// --csv FILE: one row per backend and policy.
#include "csv.hpp"
#include "lockstep/comm/flight_recorder.hpp"
#include "lockstep/comm/thread_group.hpp"
#include "lockstep/nn/batch_norm.hpp"
#include "lockstep/optim/sgd.hpp"
#include "lockstep/train/data_parallel.hpp"
#include "median.hpp"
#include "resnet50.hpp"
#if LOCKSTEP_BENCH_MPI
#include "lockstep/comm/mpi_communicator.hpp"
#include "lockstep/comm/mpi_environment.hpp"
#endif

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <tuple>
#include <vector>

using namespace lockstep;
using steady = std::chrono::steady_clock;

namespace {

struct options {
    bool quick = false;
    int reps = 15;
    std::size_t batch = 2;  ///< samples per replica
    std::size_t side = 224; ///< the input's side (224: ResNet-50's ImageNet shapes)
    std::string csv;
};

/// ResNet-50's BN layers, each with its own input (kept until backward, as a network's
/// activations are) and a shared output and gradient scratch.
template <class Policy>
class bn_stack {
public:
    using bn_policies = std::tuple<Policy>;
    using layer_type = nn::batch_norm<float, Policy, nn::nchw>;

    template <class Ctx>
    bn_stack(Ctx& ctx, const options& o)
        : shapes_(bench_nets::resnet50_bn_layers(o.side)), batch_(o.batch) {
        std::size_t largest = 0;
        for (std::size_t l = 0; l < shapes_.size(); ++l) {
            const auto& s = shapes_[l];
            layers_.push_back(std::make_unique<layer_type>(ctx.comm(), s.channels));
            names_.push_back(s.name + ".weight");
            names_.push_back(s.name + ".bias");
            names_.push_back(s.name + ".running_mean");
            names_.push_back(s.name + ".running_var");
            x_.emplace_back(elements(l, batch_));
            fill(x_.back(), static_cast<unsigned>(ctx.rank() * 131 + static_cast<int>(l)));
            largest = std::max(largest, x_.back().size());
        }
        y_.assign(largest, 0.0f);
        dx_.assign(largest, 0.0f);
        dy_.resize(largest);
        fill(dy_, static_cast<unsigned>(ctx.rank() * 131 + 977));
    }

    template <class F>
    void for_each_parameter(F&& f) {
        for (std::size_t l = 0; l < layers_.size(); ++l) {
            f(names_[4 * l], layers_[l]->gamma(), layers_[l]->dgamma());
            f(names_[4 * l + 1], layers_[l]->beta(), layers_[l]->dbeta());
        }
    }
    template <class F>
    void for_each_state(F&& f) {
        for (std::size_t l = 0; l < layers_.size(); ++l) {
            f(names_[4 * l + 2], layers_[l]->running_mean());
            f(names_[4 * l + 3], layers_[l]->running_var());
        }
    }

    /// Forward through every layer, then backward from the last to the first.
    template <class Ctx>
    void train(Ctx& ctx, const shard_range& r) {
        const std::size_t n = r.size();
        LOCKSTEP_REQUIRE(n <= batch_, errc::invalid_argument, ctx.rank(), "bn_stack::train", n,
                         " samples for buffers of ", batch_);
        for (std::size_t l = 0; l < layers_.size(); ++l) {
            const auto& s = shapes_[l];
            const std::size_t k = elements(l, n);
            layers_[l]->forward_train(ctx, std::span<const float>(x_[l].data(), k),
                                      {n, s.channels, s.side, s.side},
                                      std::span<float>(y_.data(), k));
        }
        for (std::size_t l = layers_.size(); l-- > 0;) {
            const std::size_t k = elements(l, n);
            layers_[l]->backward(ctx, std::span<const float>(dy_.data(), k),
                                 std::span<float>(dx_.data(), k));
        }
    }

private:
    std::size_t elements(std::size_t l, std::size_t n) const {
        return n * shapes_[l].channels * shapes_[l].side * shapes_[l].side;
    }
    /// Values in [-1, 1) from a counter hash, different for every seed.
    static void fill(std::vector<float>& v, unsigned seed) {
        std::uint32_t h = seed * 2654435761u + 1;
        for (float& e : v) {
            h = h * 1664525u + 1013904223u;
            e = static_cast<float>(h >> 8) * (2.0f / 16777216.0f) - 1.0f;
        }
    }

    std::vector<bench_nets::bn_layer> shapes_;
    std::size_t batch_;
    std::vector<std::unique_ptr<layer_type>> layers_;
    std::vector<std::string> names_;
    std::vector<std::vector<float>> x_;
    std::vector<float> y_, dy_, dx_;
};

template <class Policy, class Comm>
using trainer_for = data_parallel<bn_stack<Policy>, optim::sgd<float, typename Comm::system_type>,
                                  sync::synchronous, reduce::bucketed<>, Comm>;

/// One step's measurements on this replica.
struct sample {
    double step_ms = 0;
    double collective_ms = 0;   ///< this replica's time inside the collectives
    double collectives = 0;     ///< how many
    double last_arrival_ms = 0; ///< per collective the shorter replica's time, summed
};

/// The most collectives one step function may issue here (bn::global: 106).
constexpr std::size_t max_collectives = 256;

std::int64_t now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(steady::now().time_since_epoch())
        .count();
}

/// One step between barriers, and the collectives its step function issued (from the flight
/// recorder of the communicator the layers called). The replicas' times of each collective are
/// compared after the step (a min all_reduce): the replica that arrived last did not wait for
/// the other to arrive.
template <class Trainer, class Comm>
sample timed_step(Trainer& tr, Comm& comm, std::size_t global_batch) {
    std::int64_t begin = 0, end = 0;
    const flight_recorder* trace = nullptr;
    comm.barrier();
    const auto t0 = steady::now();
    tr.step(global_batch, [&](auto& net, const shard_range& r, auto& ctx) {
        trace = &ctx.comm().trace();
        begin = now_ns();
        net.train(ctx, r);
        end = now_ns();
    });
    comm.barrier();
    sample s;
    s.step_ms = std::chrono::duration<double, std::milli>(steady::now() - t0).count();
    std::vector<double> each(max_collectives, 0.0);
    std::size_t count = 0;
    for (const flight_entry& e : trace->entries())
        if (e.start_ns >= begin && e.start_ns <= end && e.end_ns != 0) {
            const double ms = static_cast<double>(e.end_ns - e.start_ns) * 1e-6;
            s.collective_ms += ms;
            if (count < each.size())
                each[count] = ms;
            ++count;
        }
    LOCKSTEP_REQUIRE(count <= max_collectives, errc::internal, comm.rank(), "bench_bn_step", count,
                     " collectives in one step function, more than ", max_collectives);
    s.collectives = static_cast<double>(count);
    comm.all_reduce(std::span<const double>(each), std::span<double>(each), reduce_op::min);
    for (const double ms : each)
        s.last_arrival_ms += ms;
    return s;
}

using bench_stats::median;

/// What one backend measured for one policy (medians).
struct row {
    std::string policy;
    double collectives = 0; ///< per step, on one replica
    double step_ms = 0;
    double collective_ms = 0;
    double last_arrival_ms = 0;
    double minus_local_ms = 0; ///< paired step(global) - step(local)
};

/// The global and the local trainer, stepped round-robin; returns {global, local} (valid on
/// every replica).
template <class Comm>
std::vector<row> run_all(Comm& comm, const options& o) {
    const auto sgd = optim::sgd_params{.lr = 1e-3, .momentum = 0.9};
    const train_params tp{.overlap = overlap_mode::never};
    trainer_for<bn::global, Comm> global(
        comm, [&](auto& ctx) { return bn_stack<bn::global>(ctx, o); }, sgd, tp);
    trainer_for<bn::local, Comm> local(
        comm, [&](auto& ctx) { return bn_stack<bn::local>(ctx, o); }, sgd, tp);
    const std::size_t global_batch = o.batch * static_cast<std::size_t>(comm.size());
    const int reps = o.quick ? 3 : o.reps, warm = 2;
    // Per repetition r and policy p (0 global, 1 local): step[2r + p] its step ms, other[6r + 3p]
    // its collective ms, other[6r + 3p + 1] its collective count, other[6r + 3p + 2] its
    // last-arrival ms (the same on every replica).
    const auto n = static_cast<std::size_t>(reps);
    std::vector<double> step(2 * n), other(6 * n);
    for (int r = -warm; r < reps; ++r) {
        sample g, l;
        if (r % 2 == 0) {
            g = timed_step(global, comm, global_batch);
            l = timed_step(local, comm, global_batch);
        } else {
            l = timed_step(local, comm, global_batch);
            g = timed_step(global, comm, global_batch);
        }
        if (r < 0)
            continue;
        const auto i = static_cast<std::size_t>(r);
        for (std::size_t p = 0; p < 2; ++p) {
            const sample& x = p == 0 ? g : l;
            step[2 * i + p] = x.step_ms;
            other[6 * i + 3 * p] = x.collective_ms;
            other[6 * i + 3 * p + 1] = x.collectives;
            other[6 * i + 3 * p + 2] = x.last_arrival_ms;
        }
    }
    // The slower replica's step; the replicas' mean of the collective figures.
    comm.all_reduce(std::span<const double>(step), std::span<double>(step), reduce_op::max);
    comm.all_reduce(std::span<const double>(other), std::span<double>(other), reduce_op::sum);
    for (double& v : other)
        v /= comm.size();
    std::vector<row> out(2);
    out[0].policy = "global";
    out[1].policy = "local";
    for (std::size_t p = 0; p < 2; ++p) {
        std::vector<double> s, c, k, a, d;
        for (std::size_t i = 0; i < n; ++i) {
            s.push_back(step[2 * i + p]);
            c.push_back(other[6 * i + 3 * p]);
            k.push_back(other[6 * i + 3 * p + 1]);
            a.push_back(other[6 * i + 3 * p + 2]);
            d.push_back(step[2 * i + p] - step[2 * i + 1]);
        }
        out[p].step_ms = median(s);
        out[p].collective_ms = median(c);
        out[p].collectives = median(k);
        out[p].last_arrival_ms = median(a);
        out[p].minus_local_ms = median(d);
    }
    return out;
}

void report(const std::vector<row>& rows, const char* backend, int replicas, const options& o,
            bench_csv::writer& csv) {
    const row& local = rows[1];
    std::printf("%-13s %2s %-7s %12s %9s %14s %11s %13s %11s %16s\n", "backend", "n", "policy",
                "collectives", "step ms", "collective ms", "coll/step", "last-arr. ms",
                "step/local", "global-local ms");
    for (const row& r : rows) {
        std::printf("%-13s %2d %-7s %12.0f %9.2f %14.3f %11.3f %13.3f %11.3f %16.2f\n", backend,
                    replicas, r.policy.c_str(), r.collectives, r.step_ms, r.collective_ms,
                    r.collective_ms / r.step_ms, r.last_arrival_ms, r.step_ms / local.step_ms,
                    r.minus_local_ms);
        csv.row({"bn_step", backend, replicas, o.batch, o.side, r.policy, r.collectives, r.step_ms,
                 r.collective_ms, r.collective_ms / r.step_ms, r.last_arrival_ms,
                 r.step_ms / local.step_ms, r.minus_local_ms});
    }
}

void print_machine(const options& o) {
    double load[3] = {-1, -1, -1};
    if (FILE* f = std::fopen("/proc/loadavg", "r")) {
        if (std::fscanf(f, "%lf %lf %lf", &load[0], &load[1], &load[2]) != 3)
            load[0] = load[1] = load[2] = -1;
        std::fclose(f);
    }
    const auto layers = bench_nets::resnet50_bn_layers(o.side);
    std::size_t channels = 0, values = 0;
    for (const auto& l : layers) {
        channels += l.channels;
        values += l.channels * l.side * l.side;
    }
    std::printf("bench_bn_step: ResNet-50's %zu BN layers at a %zu x %zu input (%zu channels, "
                "%.2f M values per sample), %zu samples per replica, NCHW float; %d "
                "repetitions (median), load average %.2f %.2f %.2f\n",
                layers.size(), o.side, o.side, channels, static_cast<double>(values) * 1e-6,
                o.batch, o.quick ? 3 : o.reps, load[0], load[1], load[2]);
    std::printf("collective ms: time inside the step function's collectives (flight recorder), "
                "mean over replicas; last-arr.: per collective the shorter replica's time, "
                "summed; global-local: paired step-time difference\n\n");
}

options parse(int argc, char** argv) {
    options o;
    for (int i = 1; i < argc; ++i) {
        const std::string a = argv[i];
        const bool has_value = i + 1 < argc;
        if (a == "--quick")
            o.quick = true;
        else if (a == "--reps" && has_value)
            o.reps = std::max(1, std::atoi(argv[++i]));
        else if (a == "--batch" && has_value)
            o.batch = static_cast<std::size_t>(std::max(1, std::atoi(argv[++i])));
        else if (a == "--side" && has_value)
            o.side = static_cast<std::size_t>(std::max(32, std::atoi(argv[++i])));
        else if (a == "--csv" && has_value)
            o.csv = argv[++i];
        else {
            std::fprintf(stderr,
                         "usage: %s [--quick] [--reps N] [--batch B] [--side S] [--csv FILE]\n",
                         argv[0]);
            std::exit(2);
        }
    }
    return o;
}

/// The BN layers at 224 x 224 against resnet50_tensors() and resnet50_output_pixels() (two lists
/// written independently): every layer's gamma has its channels and its output pixels are
/// side x side. Returns what differs ("" when nothing).
std::string check_shapes() {
    const auto tensors = bench_nets::resnet50_tensors();
    const auto pixels = bench_nets::resnet50_output_pixels();
    std::string problems;
    std::size_t bn_tensors = 0;
    for (const auto& t : tensors)
        bn_tensors += t.name.find("bn") != std::string::npos ||
                      t.name.find("downsample.1") != std::string::npos;
    const auto layers = bench_nets::resnet50_bn_layers(224);
    if (2 * layers.size() != bn_tensors)
        problems += std::to_string(layers.size()) + " layers for " + std::to_string(bn_tensors) +
                    " BN tensors; ";
    for (const auto& l : layers) {
        const auto at = std::find_if(tensors.begin(), tensors.end(), [&](const tensor_info& t) {
            return t.name == l.name + ".weight";
        });
        if (at == tensors.end()) {
            problems += l.name + " is not in resnet50_tensors(); ";
            continue;
        }
        const auto i = static_cast<std::size_t>(at - tensors.begin());
        if (at->size != l.channels || pixels[i] != l.side * l.side)
            problems += l.name + ": " + std::to_string(l.channels) + " channels at " +
                        std::to_string(l.side) + "^2, the parameter list says " +
                        std::to_string(at->size) + " at " + std::to_string(pixels[i]) + "; ";
    }
    return problems;
}

bench_csv::writer open_csv(const std::string& path) {
    return {path,
            {"bench", "backend", "replicas", "batch_per_replica", "input_side", "policy",
             "collectives_per_step", "step_ms", "collective_ms", "collective_share",
             "last_arrival_ms", "step_over_local", "minus_local_ms"}};
}

} // namespace

int main(int argc, char** argv) {
    // A bn::global step records 106 collectives per replica (and the trainer's own); the flight
    // recorder keeps the last 64 unless told more.
    setenv("LOCKSTEP_TRACE_OPS", "1024", 1);
    if (const std::string problems = check_shapes(); !problems.empty()) {
        std::fprintf(stderr, "bench_bn_step: ResNet-50's BN shapes disagree: %s\n",
                     problems.c_str());
        return 1;
    }
#if LOCKSTEP_BENCH_MPI
    mpi_environment env(argc, argv);
    const options o = parse(argc, argv);
    mpi_communicator comm(MPI_COMM_WORLD);
    if (comm.rank() == 0)
        print_machine(o);
    const auto rows = run_all(comm, o);
    if (comm.rank() == 0) {
        auto csv = open_csv(o.csv);
        report(rows, "mpi", comm.size(), o, csv);
    }
#else
    const options o = parse(argc, argv);
    print_machine(o);
    std::vector<row> rows;
    thread_group(2).run([&](thread_communicator& comm) {
        auto mine = run_all(comm, o);
        if (comm.rank() == 0)
            rows = std::move(mine);
    });
    auto csv = open_csv(o.csv);
    report(rows, "thread_group", 2, o, csv);
#endif
    return 0;
}
