// lockstep/train/parameter_server.hpp: asynchronous parameter-server training (sync::asynchronous,
// sync::bounded_staleness<S>) over any point-to-point communicator. SPDX-License-Identifier:
// Apache-2.0
#pragma once

#include "lockstep/comm/communicator.hpp"
#include "lockstep/comm/named_timeout.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/policy/sync.hpp"
#include "lockstep/system/buffer.hpp"
#include "lockstep/train/detail/staleness_gate.hpp"

#include <algorithm>
#include <array>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <limits>
#include <span>
#include <string>
#include <vector>

namespace lockstep {

/// What a worker is asked to compute: work item `index` (0 .. steps-1; the caller maps it to a
/// batch of samples) on the parameters of server version `version`.
struct work_item {
    std::uint64_t index = 0;
    std::uint64_t version = 0;
};

/// What the server knows when it applies one gradient.
struct apply_info {
    int worker = 0;                     ///< rank that computed the gradient
    std::uint64_t index = 0;            ///< its work item
    std::uint64_t computed_version = 0; ///< the version the gradient was computed on
    /// The server version it is applied to (before the step): gradients handed to apply
    /// before it in this run_parameter_server call.
    std::uint64_t version = 0;
    std::uint64_t staleness = 0; ///< version - computed_version
};

/// Staleness measured by the server (filled on the root only; workers get computed counts).
struct staleness_report {
    /// Gradients handed to apply (== steps after a run that did not fail; the asynchronous
    /// trainers' apply skips a non-finite one, counted in async_result::skipped, as the
    /// synchronous step counts a skipped step). The fields below count the same gradients.
    std::uint64_t applied = 0;
    std::uint64_t max = 0;                ///< largest staleness applied
    double mean = 0.0;                    ///< mean staleness over applied gradients
    std::vector<std::uint64_t> histogram; ///< histogram[s] = gradients applied with staleness s
    std::vector<std::uint64_t> per_rank;  ///< gradients applied (root) / computed (worker) per rank
    std::uint64_t held_back = 0;          ///< times a worker had to wait for the staleness bound
};

/// Runtime knobs of run_parameter_server.
struct parameter_server_params {
    std::size_t steps = 0; ///< gradients the server applies in total (the budget)
    int root = 0;          ///< the server rank
    int tag = 0x5053;      ///< first of the four message tags the protocol uses (tag .. tag + 3)
};

namespace detail {
enum : int { ps_work = 0, ps_stop = 1, ps_abort = 2 };     // server -> worker commands
enum : int { ps_ok = 0, ps_failed = 1 };                   // worker -> server status
inline constexpr int ps_pull_header = 0, ps_pull_data = 1; // tag offsets
inline constexpr int ps_push_header = 2, ps_push_data = 3;
} // namespace detail

/// Parameter-server training on `comm` with SyncPolicy (sync::asynchronous or
/// sync::bounded_staleness<S>), over parameters of type T (float or double). Called by every
/// replica of the group.
///
/// Rank `p.root` is the server: it owns the master `params`, the optimizer and `state` (e.g. BN
/// running statistics). Every other rank is a worker that repeatedly
///   1. receives the newest parameters and state (written into its `params` and `state`) and
///      a work_item,
///   2. calls compute(item, grad, stats): the gradient of its batch w.r.t. `params` into grad
///      (params.size() elements) and whatever per-batch statistics the server needs into stats
///      (stats_size elements, e.g. BN batch mean/var),
///   3. pushes (gradient, version computed on, stats) to the server.
/// The server takes pushes in arrival order (recv_any) and calls apply(grad, stats, info) for
/// each AT ONCE, without waiting for other workers: apply updates params (the optimizer step)
/// and state (e.g. BN running statistics from the batch statistics); the version then grows by
/// one. Under bounded_staleness<S> the server withholds new parameters from a worker that could
/// otherwise make some gradient older than S (see detail::staleness_gate for the proof), so
/// every applied gradient has staleness <= S. After `steps` gradients the server stops every
/// worker, then params and state are broadcast from the root: on return every replica holds
/// the final parameters and state.
///
/// Failures: if compute throws on a worker, it tells the server and rethrows; the server stops
/// handing out work, collects the pushes still in flight, sends every other worker an abort
/// (they throw errc::peer_failure) and throws errc::peer_failure naming the worker. If apply
/// throws, the server aborts the workers the same way and rethrows. Nothing hangs: a wait past
/// the communicator's timeout fails with errc::timeout, on the server naming the workers it
/// waited for (work item and version), on a worker waiting for work (after two timeouts on
/// MPI and hierarchical_group, so that the server's error comes first) saying that the
/// server's error names the straggler. These are the errors the waits themselves fail with
/// (recv_any_named, recv_named), so a communicator whose policy ends the job inside the wait
/// (mpi_failure_action::abort, MPI's default) prints them.
///
/// requires: comm.size() >= 2; every replica passes the same params.size(), state.size(),
/// stats_size, steps and root (checked collectively: errc::count_mismatch on every replica);
/// steps <= INT_MAX. The communicator carries std::int64_t (thread group, MPI).
/// ensures: on the root, a staleness_report with applied == steps and max <= S.
template <sync_policy SyncPolicy, class T, point_to_point_communicator Comm, class Compute,
          class Apply>
staleness_report run_parameter_server(Comm& comm, std::span<T> params, std::span<T> state,
                                      std::size_t stats_size, const parameter_server_params& p,
                                      Compute&& compute, Apply&& apply) {
    static_assert(is_asynchronous_v<SyncPolicy>,
                  "run_parameter_server implements sync::asynchronous and "
                  "sync::bounded_staleness<S>; synchronous and local SGD training go through "
                  "data_parallel's collective path.");
    const int rank = comm.rank();
    const int size = comm.size();
    const char* op = "parameter_server";
    LOCKSTEP_REQUIRE(size >= 2, errc::invalid_argument, rank, op,
                     "asynchronous training needs a server and at least one worker, but the "
                     "group has ",
                     size, " replica(s)");
    LOCKSTEP_REQUIRE(p.root >= 0 && p.root < size, errc::invalid_argument, rank, op, "root ",
                     p.root, " is not a rank of the group of ", size);
    LOCKSTEP_REQUIRE(p.steps <= static_cast<std::size_t>(INT_MAX), errc::invalid_argument, rank, op,
                     "steps = ", p.steps, " exceeds INT_MAX");

    // Every replica must agree on the message sizes (else receives would mismatch), on the
    // budget and on the server. One all_reduce(max) of {v, -v} gives every maximum and minimum.
    {
        const std::array<std::int64_t, 5> values{
            static_cast<std::int64_t>(params.size()), static_cast<std::int64_t>(state.size()),
            static_cast<std::int64_t>(stats_size), static_cast<std::int64_t>(p.steps), p.root};
        std::array<std::int64_t, 10> both{};
        for (std::size_t i = 0; i < values.size(); ++i) {
            both[i] = values[i];
            both[i + values.size()] = -values[i];
        }
        std::array<std::int64_t, 10> agreed{};
        comm.all_reduce(std::span<const std::int64_t>(both), std::span<std::int64_t>(agreed),
                        reduce_op::max);
        static constexpr const char* names[] = {"parameter count", "state size", "statistics size",
                                                "steps", "root"};
        for (std::size_t i = 0; i < values.size(); ++i)
            LOCKSTEP_REQUIRE(agreed[i] == -agreed[i + values.size()], errc::count_mismatch, rank,
                             op, "replicas disagree on the ", names[i], ": from ",
                             -agreed[i + values.size()], " to ", agreed[i],
                             " (this replica: ", values[i], ")");
    }

    using system_type = typename Comm::system_type;
    buffer<T, system_type> payload(params.size() + stats_size, comm.system());
    const std::span<T> grad = payload.span().first(params.size());
    const std::span<T> stats = payload.span().subspan(params.size(), stats_size);
    const int tag = p.tag;
    staleness_report report;
    report.per_rank.assign(static_cast<std::size_t>(size), 0);

    if (rank != p.root) {
        std::array<int, 4> header{};
        // A worker held back by the staleness bound, or at the end told to stop only once no
        // gradient is in flight, waits for the server as long as the server waits for another
        // worker: its timeout says so and where the straggler is named.
        constexpr bool bounded =
            SyncPolicy::max_staleness != std::numeric_limits<std::size_t>::max();
        // The communicator fails with this account (recv_named), as the server's below.
        const auto waited_for_work = [&](const error& e) {
            return error(errc::timeout, rank, op,
                         detail::concat(
                             "worker ", rank, " waited for work from the server (rank ", p.root,
                             ") and got none; ",
                             bounded
                                 ? "the server holds a worker back while another's gradient would "
                                   "grow staler than the bound, so the replica that stalled may be "
                                   "another worker: the server's error names the workers it waited "
                                   "for: "
                                 : "the server, or its apply, stalled, or at the end of the run "
                                   "another worker's last gradient the server waits for before "
                                   "stopping: the server's error names the workers it waited for: ",
                             e.what()));
        };
        // It waits two timeouts where the communicator can (patient()): the server, whose wait
        // for the straggler began no later, times out first, so under a policy that ends the
        // job inside the wait its error, naming the straggler, is the one printed.
        const auto receive_work = [&] {
            recv_named(comm, std::span<int>(header), p.root, tag + detail::ps_pull_header,
                       patient(2, waited_for_work));
        };
        for (;;) {
            receive_work();
            if (header[0] == detail::ps_abort) {
                if (header[1] >= 0)
                    fail(errc::peer_failure, rank, op, "the server stopped the run: worker ",
                         header[1], " failed while computing work item ", header[2]);
                fail(errc::peer_failure, rank, op, "the server (rank ", p.root,
                     ") failed while applying work item ", header[2],
                     " and stopped the run; its own error names the cause");
            }
            if (header[0] == detail::ps_stop)
                break;
            comm.recv(params, p.root, tag + detail::ps_pull_data);
            if (!state.empty())
                comm.recv(state, p.root, tag + detail::ps_pull_data);
            const work_item item{static_cast<std::uint64_t>(header[2]),
                                 static_cast<std::uint64_t>(header[1])};
            try {
                compute(item, grad, stats);
            } catch (...) {
                const std::array<int, 4> failed{detail::ps_failed, header[1], header[2], 0};
                try {
                    comm.send(std::span<const int>(failed), p.root, tag + detail::ps_push_header);
                } catch (...) {
                    // The original failure is the one worth reporting.
                }
                throw;
            }
            const std::array<int, 4> pushed{detail::ps_ok, header[1], header[2], 0};
            comm.send(std::span<const int>(pushed), p.root, tag + detail::ps_push_header);
            comm.send(std::span<const T>(payload.span()), p.root, tag + detail::ps_push_data);
            ++report.per_rank[static_cast<std::size_t>(rank)];
        }
    } else {
        // Workers are numbered by rank; the root's slot in the gate stays unused.
        detail::staleness_gate gate(size, SyncPolicy::max_staleness);
        std::deque<int> waiting;
        for (int w = 0; w < size; ++w)
            if (w != p.root)
                waiting.push_back(w);
        const int workers = size - 1;
        int finished = 0; // workers sent stop/abort, or failed themselves
        std::size_t next_item = 0;
        bool aborting = false;
        std::exception_ptr server_failure;
        int failed_worker = -1;
        std::uint64_t failed_item = 0;
        double staleness_sum = 0.0;
        std::array<int, 4> header{};
        std::vector<std::uint64_t> item_of(static_cast<std::size_t>(size), 0); // being computed

        auto dispatch = [&] {
            while (!waiting.empty()) {
                const int w = waiting.front();
                // The last items: a worker is told to stop once no gradient is in flight, so a
                // failure applying one still reaches it as an abort (a stopped worker waits in
                // the final broadcast, which a failed server never joins).
                if (!aborting && next_item >= p.steps && gate.outstanding() > 0)
                    return;
                if (aborting || next_item >= p.steps) {
                    // An abort names who failed (a worker, or -1: the server) and its item.
                    header = {aborting ? detail::ps_abort : detail::ps_stop, failed_worker,
                              static_cast<int>(failed_item), 0};
                    comm.send(std::span<const int>(header), w, tag + detail::ps_pull_header);
                    waiting.pop_front();
                    ++finished;
                    continue;
                }
                if (!gate.can_admit(w)) {
                    ++report.held_back;
                    return;
                }
                waiting.pop_front();
                gate.admit(w);
                item_of[static_cast<std::size_t>(w)] = next_item;
                header = {detail::ps_work, static_cast<int>(gate.version()),
                          static_cast<int>(next_item++), 0};
                comm.send(std::span<const int>(header), w, tag + detail::ps_pull_header);
                comm.send(std::span<const T>(params), w, tag + detail::ps_pull_data);
                if (!state.empty())
                    comm.send(std::span<const T>(state), w, tag + detail::ps_pull_data);
            }
        };

        // A worker's failure may reach this rank twice: as its failure push, and (on backends
        // that propagate failures, like the thread group) as errc::peer_failure from the next
        // send or receive while the server drains. Report the root cause either way.
        const auto fail_aborted = [&] {
            if (server_failure)
                std::rethrow_exception(server_failure);
            fail(errc::peer_failure, rank, op, "worker ", failed_worker,
                 " failed while computing work item ", failed_item, "; ", report.applied, " of ",
                 p.steps, " gradients were applied");
        };
        // recv_any's timeout names no sender: the server knows which workers it waits for.
        // The communicator fails with the server's account (recv_any_named), so that it is what
        // a policy that ends the job inside the wait prints (mpi_failure_action::abort).
        const auto waited_for = [&](const error& e) {
            std::string who;
            for (int w = 0; w < size; ++w)
                if (w != p.root && gate.is_outstanding(w))
                    who += detail::concat(who.empty() ? "" : ", ", "worker ", w, " (work item ",
                                          item_of[static_cast<std::size_t>(w)], " on version ",
                                          gate.version_of(w), ")");
            return error(errc::timeout, rank, op,
                         detail::concat("the server waited for a gradient from ", who,
                                        " and got none; ", report.applied, " of ", p.steps,
                                        " gradients were taken: ", e.what()));
        };
        const auto receive_push = [&](std::array<int, 4>& h) {
            return recv_any_named(comm, std::span<int>(h), tag + detail::ps_push_header,
                                  waited_for);
        };
        try {
            for (;;) {
                dispatch();
                if (finished == workers)
                    break;
                LOCKSTEP_REQUIRE(gate.outstanding() > 0, errc::internal, rank, op,
                                 "no worker is computing and none can be admitted (version ",
                                 gate.version(), ", ", waiting.size(), " waiting)");
                const int src = receive_push(header);
                LOCKSTEP_REQUIRE(src != p.root && src >= 0 && src < size &&
                                     gate.is_outstanding(src),
                                 errc::internal, rank, op, "unexpected push from rank ", src);
                if (header[0] != detail::ps_ok) {
                    // The worker failed and left the protocol: it gets no further message.
                    gate.release(src);
                    ++finished;
                    if (!aborting) {
                        failed_worker = src;
                        failed_item = static_cast<std::uint64_t>(header[2]);
                    }
                    aborting = true;
                    continue;
                }
                comm.recv(payload.span(), src, tag + detail::ps_push_data);
                LOCKSTEP_REQUIRE(static_cast<std::uint64_t>(header[1]) == gate.version_of(src),
                                 errc::internal, rank, op, "worker ", src, " pushed version ",
                                 header[1], " but was given ", gate.version_of(src));
                if (aborting) {
                    gate.release(src);
                } else {
                    apply_info info;
                    info.worker = src;
                    info.index = static_cast<std::uint64_t>(header[2]);
                    info.computed_version = gate.version_of(src);
                    info.version = gate.version();
                    info.staleness = info.version - info.computed_version;
                    try {
                        apply(std::span<const T>(grad), std::span<const T>(stats), info);
                        gate.apply(src);
                        if (report.histogram.size() <= info.staleness)
                            report.histogram.resize(info.staleness + 1, 0);
                        ++report.histogram[info.staleness];
                        report.max = std::max(report.max, info.staleness);
                        staleness_sum += static_cast<double>(info.staleness);
                        ++report.applied;
                        ++report.per_rank[static_cast<std::size_t>(src)];
                    } catch (...) {
                        gate.release(src);
                        server_failure = std::current_exception();
                        failed_item = info.index;
                        aborting = true;
                    }
                }
                waiting.push_back(src);
            }
        } catch (...) {
            if (aborting)
                fail_aborted();
            throw;
        }
        if (aborting)
            fail_aborted();
        report.mean = report.applied == 0 ? 0.0 : staleness_sum / double(report.applied);
    }

    comm.broadcast(params, p.root);
    if (!state.empty())
        comm.broadcast(state, p.root);
    return report;
}

} // namespace lockstep
