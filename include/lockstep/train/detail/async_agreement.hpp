// lockstep/train/detail/async_agreement.hpp: what every replica agrees on before an asynchronous
// trainer's train() call (agree_async_call). SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/communicator.hpp"
#include "lockstep/core/detail/fnv1a.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/train/detail/agreement.hpp"

#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <span>

namespace lockstep::detail {

/// Before an asynchronous train(steps, batch) call's first message (collective: one
/// all_reduce of 13 doubles on core.comm()): every replica checks the learning rate of each
/// version the call applies (core.checked_lr) and agrees on the trainer (its ordinal on the
/// communicator), steps, batch and those rates (their sum and a hash of their bits in version
/// order). Throws lockstep::error on every replica, before any work: a replica whose schedule
/// refused a rate (or threw) rethrows that, the others errc::invalid_argument naming it; another
/// trainer, or other rates, errc::invalid_argument; other steps or batch, errc::count_mismatch;
/// each naming the lowest and highest value.
template <class Core>
void agree_async_call(Core& core, std::size_t steps, std::size_t batch) {
    auto& comm = core.comm();
    // The server applies version v with lr_for(v): check them all before any collective,
    // so a bad schedule throws on every replica with nothing changed, not on the server
    // mid-run.
    // The sum names the rates in the message; a hash of their bits in version order catches
    // rates that differ but sum alike (the same rates in another order).
    // A rate refused on some replicas only (a schedule that differs by replica) is reported
    // through the all_reduce below, so the others throw too rather than wait in it.
    double lr_sum = 0;
    std::uint64_t lr_hash = detail::fnv1a_basis;
    std::exception_ptr bad_lr;
    try {
        for (std::size_t k = 0; k < steps; ++k) {
            const double lr =
                core.checked_lr(core.steps() + static_cast<std::int64_t>(k), "async_trainer.train");
            lr_sum += lr;
            const double zero_signless = lr == 0 ? 0.0 : lr; // -0.0 applies as 0.0
            lr_hash = detail::fnv1a_u64(std::bit_cast<std::uint64_t>(zero_signless), lr_hash);
        }
    } catch (...) { // a lockstep::error, or the schedule's own exception
        bad_lr = std::current_exception();
    }
    {
        // Workers map work items to samples with `batch`, and the server applies the
        // schedule it holds: every replica must have the same of both (an lr set on one
        // replica only would be ignored on a worker, or silently change the run on the
        // server), and train the same trainer (another one's messages would be taken for
        // this one's). Exact in double: batch and the ordinal < 2^53, the hash's 32-bit
        // halves, and equal schedules sum alike.
        // Also `steps`: the sums of rates over different step counts differ, and would be
        // blamed on the rates.
        const auto nb = static_cast<double>(batch);
        const auto ordinal = static_cast<double>(core.ordinal());
        const auto ns = static_cast<double>(steps);
        const auto hi = static_cast<double>(lr_hash >> 32);
        const auto lo = static_cast<double>(lr_hash & 0xffffffffu);
        const double refused = bad_lr ? comm.rank() + 1.0 : 0.0; // the last refusing rank
        const std::array<double, 13> b{nb,  -nb, lr_sum, -lr_sum, ordinal, -ordinal, ns,
                                       -ns, hi,  -hi,    lo,      -lo,     refused};
        std::array<double, 13> agreed{};
        comm.all_reduce(std::span<const double>(b), std::span<double>(agreed), reduce_op::max);
        if (bad_lr)
            std::rethrow_exception(bad_lr);
        LOCKSTEP_REQUIRE(agreed[12] == 0, errc::invalid_argument, comm.rank(),
                         "data_parallel.train", "replica ", static_cast<int>(agreed[12]) - 1,
                         " refused a learning rate of versions ", core.steps(), "..",
                         core.steps() + static_cast<std::int64_t>(steps) - 1,
                         " that this replica's schedule accepts: its error names the version "
                         "and the value; set train_params::lr alike on every replica");
        LOCKSTEP_REQUIRE(agreed[4] == -agreed[5], errc::invalid_argument, comm.rank(),
                         "data_parallel.train", "the replicas train different trainers: trainer #",
                         static_cast<std::uint64_t>(-agreed[5]), " to #",
                         static_cast<std::uint64_t>(agreed[4]),
                         " on this communicator (this replica: #", core.ordinal(),
                         "): every replica must train its trainers in the same order");
        LOCKSTEP_REQUIRE(agreed[6] == -agreed[7], errc::count_mismatch, comm.rank(),
                         "data_parallel.train", "replicas disagree on the steps: from ", -agreed[7],
                         " to ", agreed[6], " (this replica: ", steps,
                         "): every replica calls train() with the same steps and batch");
        LOCKSTEP_REQUIRE(agreed[0] == -agreed[1], errc::count_mismatch, comm.rank(),
                         "data_parallel.train", "replicas disagree on the batch size: from ",
                         -agreed[1], " to ", agreed[0], " (this replica: ", batch, ")");
        LOCKSTEP_REQUIRE(
            agreed[2] == -agreed[3] && agreed[8] == -agreed[9] && agreed[10] == -agreed[11],
            errc::invalid_argument, comm.rank(), "data_parallel.train",
            "replicas disagree on the learning rates of versions ", core.steps(), "..",
            core.steps() + static_cast<std::int64_t>(steps) - 1, " (their sum: from ",
            detail::exact(-agreed[3]), " to ", detail::exact(agreed[2]),
            ", this replica: ", detail::exact(lr_sum),
            agreed[2] == -agreed[3] ? "; equal sums of rates that differ version by version" : "",
            "): set optimizer().set_lr or train_params::lr alike on every replica");
    }
}

} // namespace lockstep::detail
