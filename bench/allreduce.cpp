// bench_allreduce: all_reduce (sum, float) from 4 B to 256 MiB on thread_group (2 replicas)
// beside memcpy / STREAM-copy bandwidth and the traffic bound, and on mpi_communicator beside
// raw MPI_Allreduce on the same buffers. SPDX-License-Identifier: Apache-2.0
//
//   bench_allreduce [--max-mib M] [--reps-scale X] [--csv F]              thread_group part
//   mpiexec -n 2 bench_allreduce [--max-mib M] [--reps-scale X] [--csv F] MPI part (world > 1)
//
// Every time is the median over repetitions of the slowest replica's time for one call, each
// call started right after a barrier, after warm-up calls (and, for the thread group, after a
// throwaway run of the smallest size). Sizes are the bytes of one replica's buffer (S); algorithm
// bandwidth = S / time; bus bandwidth = algorithm bandwidth x 2 (n - 1) / n for n replicas (NCCL's
// convention: comparable across replica counts).
//
// --csv F (written by the process of rank 0): one row per measured point: backend
// (thread_group, mpi), variant (lockstep, raw, plain, verify, copy anchors), bytes, time,
// algorithm and bus bandwidth, the ratio to the row's anchor and which anchor that is.
#include "csv.hpp"
#include "lockstep/comm/mpi_communicator.hpp"
#include "lockstep/comm/thread_group.hpp"
#include "lockstep/system/buffer.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#if LOCKSTEP_HAS_OPENMP
#include <omp.h>
#endif

namespace {

using clock_type = std::chrono::steady_clock;

double seconds_since(clock_type::time_point t0) {
    return std::chrono::duration<double>(clock_type::now() - t0).count();
}

double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    const std::size_t n = v.size();
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

struct options {
    std::size_t max_bytes = std::size_t{256} << 20;
    double reps_scale = 1.0;
    std::string csv; ///< --csv: the CSV file ("" for none)
};

// The CSV's columns (one writer per process; only rank 0 passes a file name).
lockstep::bench_csv::writer open_csv(const std::string& path) {
    return {path,
            {"bench", "backend", "replicas", "variant", "bytes", "time_us", "algbw_gbps",
             "busbw_gbps", "ratio", "ratio_to"}};
}

// Bus bandwidth in GB/s of an all_reduce of `bytes` per replica over n replicas in t seconds.
double busbw_gbps(std::size_t bytes, double t, int n) {
    return double(bytes) / t * 2.0 * (n - 1) / n * 1e-9;
}

// 4 B, 16 B, ..., max_bytes (powers of 4).
std::vector<std::size_t> sizes(const options& o) {
    std::vector<std::size_t> s;
    for (std::size_t b = 4; b <= o.max_bytes; b *= 4)
        s.push_back(b);
    return s;
}

// Repetitions: many for small messages (noise), few for large ones (each moves ~GBs).
int reps_for(std::size_t bytes, const options& o) {
    const double r =
        std::clamp(static_cast<double>(std::size_t{2} << 30) / double(bytes), 9.0, 400.0) *
        o.reps_scale;
    return std::max(5, static_cast<int>(r)) | 1; // odd: the median is one measurement
}

void fill(std::span<float> x, int rank) {
    for (std::size_t i = 0; i < x.size(); ++i)
        x[i] = static_cast<float>((i * 7 + static_cast<std::size_t>(rank) * 13) % 1000) * 0.001f;
}

// The STREAM copy kernel b[i] = a[i]. The build keeps GCC from turning it into a memcpy call
// (-fno-tree-loop-distribute-patterns): memcpy's non-temporal stores skip the write-allocate
// traffic that ordinary stores (like the reduction's) pay.
void stream_copy(const float* __restrict a, float* __restrict b, std::size_t n) {
    for (std::size_t i = 0; i < n; ++i)
        b[i] = a[i];
}

// ---- (1) thread_group, 2 replicas -------------------------------------------------------------

struct copy_bandwidth {
    double memcpy_1thread;  // bytes copied per second, one thread, std::memcpy
    double memcpy_2threads; // STREAM convention (read + write bytes) / s, 2 threads, memcpy
    double stream_2threads; // STREAM convention (read + write bytes) / s, 2 threads, loop
};

// Copies measured on the replicas' own threads: each copies its half of a into b (pages
// first touched by the thread that copies them).
copy_bandwidth measure_copies(std::size_t bytes, int reps) {
    const std::size_t n = bytes / sizeof(float);
    std::vector<float> a(n), b(n);
    copy_bandwidth bw{};
    {
        fill(a, 0);
        std::vector<double> t;
        for (int r = 0; r < reps + 2; ++r) {
            const auto t0 = clock_type::now();
            std::memcpy(b.data(), a.data(), bytes);
            if (r >= 2)
                t.push_back(seconds_since(t0));
        }
        bw.memcpy_1thread = double(bytes) / median(t);
    }
    std::vector<double> t_memcpy(static_cast<std::size_t>(reps)), t_loop(t_memcpy.size());
    lockstep::thread_group group(2);
    group.run([&](lockstep::thread_communicator& comm) {
        const std::size_t half = n / 2, lo = comm.rank() * half;
        const std::size_t len = comm.rank() == 1 ? n - half : half;
        std::span<float> mine(a.data() + lo, len);
        fill(mine, comm.rank());
        std::fill(b.data() + lo, b.data() + lo + len, 0.0f);
        for (int k = 0; k < 2; ++k)
            for (int r = -2; r < reps; ++r) {
                comm.barrier();
                const auto t0 = clock_type::now();
                if (k == 0)
                    std::memcpy(b.data() + lo, a.data() + lo, len * sizeof(float));
                else
                    stream_copy(a.data() + lo, b.data() + lo, len);
                comm.barrier(); // the copy ends when the slower thread ends
                if (r >= 0 && comm.rank() == 0)
                    (k == 0 ? t_memcpy : t_loop)[static_cast<std::size_t>(r)] = seconds_since(t0);
            }
    });
    bw.memcpy_2threads = 2.0 * double(bytes) / median(t_memcpy);
    bw.stream_2threads = 2.0 * double(bytes) / median(t_loop);
    return bw;
}

// Median time of one thread_group all_reduce of `bytes` per replica (slowest replica).
double time_thread_group(std::size_t bytes, const options& o) {
    const std::size_t n = bytes / sizeof(float);
    const int reps = reps_for(bytes, o), warm = std::max(2, reps / 10);
    std::vector<double> t0s(2 * static_cast<std::size_t>(reps)), t(t0s.size());
    lockstep::thread_group group(2);
    group.run([&](lockstep::thread_communicator& comm) {
        lockstep::buffer<float> send(n, comm.system()), recv(n, comm.system());
        fill(send.span(), comm.rank());
        std::fill(recv.begin(), recv.end(), 0.0f);
        for (int r = -warm; r < reps; ++r) {
            comm.barrier();
            const auto t0 = clock_type::now();
            comm.all_reduce(std::span<const float>(send.data(), n), recv.span(),
                            lockstep::reduce_op::sum);
            const double dt = seconds_since(t0);
            if (r >= 0)
                t[2 * static_cast<std::size_t>(r) + static_cast<std::size_t>(comm.rank())] = dt;
        }
    });
    std::vector<double> slowest(static_cast<std::size_t>(reps));
    for (std::size_t r = 0; r < slowest.size(); ++r)
        slowest[r] = std::max(t[2 * r], t[2 * r + 1]);
    return median(slowest);
}

// all_reduce of `bytes` per replica and, interleaved with it on the same 2 threads, each thread
// copying its own `bytes` (a STREAM copy of 2 * bytes, half per thread). That copy reads 2*S
// and writes 2*S, exactly the all_reduce's traffic bound, so time/bound = t_all_reduce /
// t_copy, both of the slowest thread, measured under the same machine load: `ratio` is the
// median over repetitions of that repetition's all_reduce / copy (a slow spell of the VM hits
// both halves of a pair), all_reduce and copy the medians of the times.
struct paired_result {
    double all_reduce, copy, ratio;
};
// t holds, per repetition r, both threads' all_reduce times at 4 r and 4 r + 1 and their copy
// times at 4 r + 2 and 4 r + 3 (several runs' repetitions may follow each other).
paired_result slowest_medians(const std::vector<double>& t) {
    std::vector<double> reduce(t.size() / 4), copy(reduce.size()), ratio(reduce.size());
    for (std::size_t r = 0; r < reduce.size(); ++r) {
        reduce[r] = std::max(t[4 * r], t[4 * r + 1]);
        copy[r] = std::max(t[4 * r + 2], t[4 * r + 3]);
        ratio[r] = reduce[r] / copy[r];
    }
    return {median(reduce), median(copy), median(ratio)};
}

std::vector<double> time_paired(std::size_t bytes, int reps) {
    const std::size_t n = bytes / sizeof(float);
    std::vector<double> t(4 * static_cast<std::size_t>(reps));
    lockstep::thread_group group(2);
    group.run([&](lockstep::thread_communicator& comm) {
        lockstep::buffer<float> send(n, comm.system()), recv(n, comm.system());
        lockstep::buffer<float> a(n, comm.system()), b(n, comm.system());
        fill(send.span(), comm.rank());
        fill(a.span(), comm.rank());
        std::fill(recv.begin(), recv.end(), 0.0f);
        std::fill(b.begin(), b.end(), 0.0f);
        const auto me = static_cast<std::size_t>(comm.rank());
        for (int r = -2; r < reps; ++r) {
            comm.barrier();
            auto t0 = clock_type::now();
            comm.all_reduce(std::span<const float>(send.data(), n), recv.span(),
                            lockstep::reduce_op::sum);
            const double t_reduce = seconds_since(t0);
            comm.barrier();
            t0 = clock_type::now();
            stream_copy(a.data(), b.data(), n);
            const double t_copy = seconds_since(t0);
            if (r >= 0) {
                t[4 * static_cast<std::size_t>(r) + me] = t_reduce;
                t[4 * static_cast<std::size_t>(r) + 2 + me] = t_copy;
            }
        }
    });
    return t;
}

#if LOCKSTEP_HAS_OPENMP
// The same pairing for a plain OpenMP all_reduce written without lockstep: 2 OpenMP threads,
// each owning a send and a recv buffer; thread t sums half t of both sends into its recv
// (reduce-scatter), a barrier, then copies the other half out of the peer's recv (all-gather).
// Returns the times as time_paired does.
std::vector<double> time_paired_openmp(std::size_t bytes, int reps) {
    const std::size_t n = bytes / sizeof(float);
    std::vector<double> t(4 * static_cast<std::size_t>(reps));
    std::vector<float> send[2], recv[2], a[2], b[2];
#pragma omp parallel num_threads(2)
    {
        const int me = omp_get_thread_num();
        const auto m = static_cast<std::size_t>(me);
        if (omp_get_num_threads() == 2) {
            // Each thread first-touches its own buffers, as the replicas do.
            send[m].assign(n, 0.0f);
            recv[m].assign(n, 0.0f);
            a[m].assign(n, 0.0f);
            b[m].assign(n, 0.0f);
            fill(send[m], me);
            fill(a[m], me);
#pragma omp barrier
            const std::size_t half = n / 2;
            const std::size_t lo = me == 0 ? 0 : half, hi = me == 0 ? half : n;
            const std::size_t plo = me == 0 ? half : 0, phi = me == 0 ? n : half;
            const float* s0 = send[0].data();
            const float* s1 = send[1].data();
            float* mine = recv[m].data();
            const float* peer = recv[1 - m].data();
            for (int r = -2; r < reps; ++r) {
#pragma omp barrier
                auto t0 = clock_type::now();
                for (std::size_t i = lo; i < hi; ++i)
                    mine[i] = s0[i] + s1[i];
#pragma omp barrier
                std::memcpy(mine + plo, peer + plo, (phi - plo) * sizeof(float));
                const double t_reduce = seconds_since(t0);
#pragma omp barrier
                t0 = clock_type::now();
                stream_copy(a[m].data(), b[m].data(), n);
                const double t_copy = seconds_since(t0);
                if (r >= 0) {
                    t[4 * static_cast<std::size_t>(r) + m] = t_reduce;
                    t[4 * static_cast<std::size_t>(r) + 2 + m] = t_copy;
                }
            }
        }
    }
    return t;
}
#endif

void run_threads(const options& o) {
    const std::size_t anchor_bytes = std::size_t{64} << 20;
    const copy_bandwidth bw = measure_copies(anchor_bytes, 11);
    auto csv = open_csv(o.csv);
    const auto anchor_row = [&](const char* variant, double bytes_per_s) {
        csv.row({"allreduce", "thread_group", 2, variant, anchor_bytes,
                 double(anchor_bytes) / bytes_per_s * 1e6, bytes_per_s * 1e-9, "", "", ""});
    };
    anchor_row("memcpy_1thread", bw.memcpy_1thread);
    anchor_row("memcpy_2threads", bw.memcpy_2threads);
    anchor_row("stream_copy_2threads", bw.stream_2threads);
    std::printf("thread_group all_reduce (sum, float), 2 replicas, %d hardware threads\n",
                lockstep::host_system::default_threads(1));
    std::printf("anchors (64 MiB arrays): memcpy 1 thread %.2f GB/s copied; 2 threads each "
                "copying half: memcpy %.2f GB/s, STREAM copy loop %.2f GB/s (read + write)\n",
                bw.memcpy_1thread * 1e-9, bw.memcpy_2threads * 1e-9, bw.stream_2threads * 1e-9);
    std::printf("traffic bound: 2 replicas read 2*S and write 2*S, time >= 4*S / STREAM copy "
                "(a DRAM bound: sizes that stay in cache can beat it)\n\n");
    std::printf("%12s %12s %12s %12s %12s\n", "bytes", "time us", "algbw GB/s", "bound us",
                "time/bound");
    // A throwaway run of the smallest size first. A replica that waits longer than its spin
    // budget (at a collective's entry about twice its recent entry waits, 4 to 200 us,
    // detail::shm sync) sleeps, and waking it costs ~15 us on the 2-core VM; two replicas that
    // start out of step keep waking each other until their spin has adapted, so the first calls
    // of the first row paid a wake-up each (15 us at 4 B before this run). On a loaded machine
    // a row can still pay them (once per phase: ~15 us up to 4 KiB, ~30 us from 16 KiB): such
    // rows measure sleeps, not the transfer.
    if (const auto all = sizes(o); !all.empty())
        (void)time_thread_group(all.front(), o);
    for (const std::size_t bytes : sizes(o)) {
        const double t = time_thread_group(bytes, o);
        const double bound = 4.0 * double(bytes) / bw.stream_2threads;
        std::printf("%12zu %12.2f %12.3f %12.2f %12.2f\n", bytes, t * 1e6, double(bytes) / t * 1e-9,
                    bound * 1e6, t / bound);
        std::fflush(stdout);
        csv.row({"allreduce", "thread_group", 2, "lockstep", bytes, t * 1e6,
                 double(bytes) / t * 1e-9, busbw_gbps(bytes, t, 2), t / bound, "traffic_bound"});
        csv.row({"allreduce", "thread_group", 2, "traffic_bound", bytes, bound * 1e6,
                 double(bytes) / bound * 1e-9, busbw_gbps(bytes, bound, 2), 1.0, "traffic_bound"});
    }
    std::printf("\npaired with a STREAM copy of the same bytes on the same threads, interleaved "
                "(robust to load); the copy moves the all_reduce's traffic bound, so time/bound "
                "= all_reduce / copy;\nplain = an OpenMP reduce-scatter + all-gather without "
                "lockstep, paired the same way; lockstep/plain = the two time/bound ratios\n"
                "%12s %12s %12s %14s %12s %12s %14s\n",
                "bytes", "all_red. us", "copy us", "copy GB/s", "time/bound", "plain/bound",
                "lockstep/plain");
    // From 4 MiB, where the data (send, recv and the copy's a and b, per thread) exceeds the
    // caches, so both sides run against DRAM.
    for (std::size_t bytes = std::size_t{4} << 20; bytes <= o.max_bytes; bytes *= 4) {
        // About 1 GiB per row and all_reduce (at least 9 repetitions): a median over few calls
        // of a size that takes well under a millisecond is at the mercy of one slow spell of the
        // VM. The two all_reduces take turns in 3 rounds, so a spell that outlasts a round hits
        // both.
        const int reps = std::max(3, static_cast<int>((std::size_t{1} << 30) / bytes / 3));
        std::vector<double> lt, pt;
        for (int round = 0; round < 3; ++round) {
            const std::vector<double> l = time_paired(bytes, reps);
            lt.insert(lt.end(), l.begin(), l.end());
#if LOCKSTEP_HAS_OPENMP
            const std::vector<double> p = time_paired_openmp(bytes, reps);
            pt.insert(pt.end(), p.begin(), p.end());
#endif
        }
        const paired_result pr = slowest_medians(lt);
        double plain = 0;
#if LOCKSTEP_HAS_OPENMP
        const paired_result pp = slowest_medians(pt);
        plain = pp.ratio;
#endif
        const double ratio = pr.ratio;
        std::printf("%12zu %12.1f %12.1f %14.2f %12.3f %12.3f %14.3f\n", bytes, pr.all_reduce * 1e6,
                    pr.copy * 1e6, 4.0 * double(bytes) / pr.copy * 1e-9, ratio, plain,
                    plain > 0 ? ratio / plain : 0.0);
        std::fflush(stdout);
        csv.row({"allreduce", "thread_group", 2, "lockstep_paired", bytes, pr.all_reduce * 1e6,
                 double(bytes) / pr.all_reduce * 1e-9, busbw_gbps(bytes, pr.all_reduce, 2), ratio,
                 "paired_copy"});
        csv.row({"allreduce", "thread_group", 2, "paired_copy", bytes, pr.copy * 1e6,
                 double(bytes) / pr.copy * 1e-9, busbw_gbps(bytes, pr.copy, 2), 1.0,
                 "paired_copy"});
#if LOCKSTEP_HAS_OPENMP
        csv.row({"allreduce", "thread_group", 2, "openmp_paired", bytes, pp.all_reduce * 1e6,
                 double(bytes) / pp.all_reduce * 1e-9, busbw_gbps(bytes, pp.all_reduce, 2), plain,
                 "openmp_paired_copy"});
#endif
    }
}

// ---- (2) mpi_communicator vs raw MPI_Allreduce ------------------------------------------------

void run_mpi(const options& o) {
    lockstep::mpi_communicator checked(MPI_COMM_WORLD);
    lockstep::mpi_communicator unchecked(MPI_COMM_WORLD, {.verify = false});
    const int rank = checked.rank();
    auto csv = open_csv(rank == 0 ? o.csv : std::string());
    if (rank == 0) {
        char lib[MPI_MAX_LIBRARY_VERSION_STRING] = {};
        int len = 0;
        MPI_Get_library_version(lib, &len);
        std::string first_line(lib, static_cast<std::size_t>(len));
        first_line.resize(std::min(first_line.find('\n'), first_line.size()));
        int level = 0;
        MPI_Query_thread(&level);
        std::printf("mpi_communicator all_reduce (sum, float) vs raw MPI_Allreduce, %d ranks, "
                    "%s, thread level %d\n",
                    checked.size(), first_line.c_str(), level);
        std::printf("raw = MPI_Allreduce on the same communicator and buffers; verify = "
                    "lockstep with the signature check (default), plain = {.verify = false};\n"
                    "times are medians; best p/r = fastest plain / fastest raw\n\n");
        std::printf("%12s %11s %11s %11s %12s %11s %11s %11s\n", "bytes", "raw us", "plain us",
                    "verify us", "raw GB/s", "plain/raw", "verify/raw", "best p/r");
    }
    MPI_Comm raw_comm = unchecked.native();
    for (const std::size_t bytes : sizes(o)) {
        const std::size_t n = bytes / sizeof(float);
        const int reps = reps_for(bytes, o), warm = std::max(2, reps / 10);
        lockstep::buffer<float> send(n, checked.system()), recv(n, checked.system());
        fill(send.span(), rank);
        std::fill(recv.begin(), recv.end(), 0.0f);
        const std::span<const float> in(send.data(), n);
        // t[v * reps + r]: variant v (raw, plain, verify) at repetition r, interleaved (and
        // the order rotated) so that drift in the machine's load affects all three alike.
        std::vector<double> t(3 * static_cast<std::size_t>(reps));
        for (int r = -warm; r < reps; ++r)
            for (int k = 0; k < 3; ++k) {
                const int v = (k + r + warm) % 3;
                MPI_Barrier(MPI_COMM_WORLD);
                const auto t0 = clock_type::now();
                if (v == 0)
                    LOCKSTEP_MPI_CHECK(MPI_Allreduce(send.data(), recv.data(), static_cast<int>(n),
                                                     MPI_FLOAT, MPI_SUM, raw_comm));
                else
                    (v == 1 ? unchecked : checked)
                        .all_reduce(in, recv.span(), lockstep::reduce_op::sum);
                const double dt = seconds_since(t0);
                if (r >= 0)
                    t[static_cast<std::size_t>(v * reps + r)] = dt;
            }
        // The slowest rank's time of each call.
        LOCKSTEP_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, t.data(), static_cast<int>(t.size()),
                                         MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD));
        const auto med = [&](int v) {
            return median(std::vector<double>(t.begin() + v * reps, t.begin() + (v + 1) * reps));
        };
        const auto best = [&](int v) {
            return *std::min_element(t.begin() + v * reps, t.begin() + (v + 1) * reps);
        };
        const double raw = med(0), plain = med(1), verify = med(2);
        if (rank == 0) {
            std::printf("%12zu %11.2f %11.2f %11.2f %12.3f %11.3f %11.3f %11.3f\n", bytes,
                        raw * 1e6, plain * 1e6, verify * 1e6, double(bytes) / raw * 1e-9,
                        plain / raw, verify / raw, best(1) / best(0));
            std::fflush(stdout);
            const char* names[3] = {"raw", "plain", "verify"};
            for (int v = 0; v < 3; ++v) {
                const double tv = med(v);
                csv.row({"allreduce", "mpi", checked.size(), names[v], bytes, tv * 1e6,
                         double(bytes) / tv * 1e-9, busbw_gbps(bytes, tv, checked.size()), tv / raw,
                         "raw"});
            }
        }
    }
}

} // namespace

int main(int argc, char** argv) {
    lockstep::mpi_environment env(argc, argv);
    options o;
    for (int i = 1; i + 1 < argc; i += 2) {
        const std::string a = argv[i];
        if (a == "--max-mib")
            o.max_bytes = static_cast<std::size_t>(std::atof(argv[i + 1]) * double(1 << 20));
        else if (a == "--reps-scale")
            o.reps_scale = std::atof(argv[i + 1]);
        else if (a == "--csv")
            o.csv = argv[i + 1];
        else {
            std::fprintf(stderr,
                         "usage: [mpiexec -n 2] %s [--max-mib M] [--reps-scale X] [--csv F]\n",
                         argv[0]);
            return 2;
        }
    }
    int world = 1;
    MPI_Comm_size(MPI_COMM_WORLD, &world);
    try {
        if (world > 1)
            run_mpi(o);
        else
            run_threads(o);
    } catch (const std::exception& e) {
        std::fprintf(stderr, "bench_allreduce: %s\n", e.what());
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    return 0;
}
