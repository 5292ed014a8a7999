// lockstep/train/detail/anchored_accumulator.hpp: the order-independent accumulator of
// reduce::reproducible's chunk gradients and losses over the replicas of a communicator: keeps
// the chunks, exchanges them (gathered, by blocks, or combined in one pass) and sums each
// element once. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/combine.hpp"
#include "lockstep/comm/communicator.hpp"
#include "lockstep/core/config.hpp"
#include "lockstep/kernels/anchored_sum.hpp"
#include "lockstep/kernels/detail/anchored_combine.hpp"
#include "lockstep/kernels/for_each.hpp"
#include "lockstep/system/buffer.hpp"
#include "lockstep/train/detail/anchored_keeper.hpp"
#include "lockstep/train/detail/anchored_row.hpp"

#include <cstddef>
#include <limits>
#include <span>
#include <vector>

namespace lockstep::detail {

/// Task k < calls * tail: value c = k / tail of tail element t = k % tail (element first + t) of
/// this replica's chunks, or 0 past its last chunk.
template <class T>
struct anchored_tail_fn {
    kernels::anchored_chunks<T> chunks;
    std::size_t first;
    std::size_t tail;
    T* out;
    LOCKSTEP_HOST_DEVICE void operator()(std::size_t k) const {
        const std::size_t c = k / tail;
        out[k] = c < chunks.count ? chunks.value(c, first + k % tail) : T(0);
    }
};

/// How an accumulator's chunks reach the sums, fixed by its communicator's type
/// (anchored_exchange_for); the bits are the same for all.
enum class anchored_exchange {
    blocks,   ///< gathered when small, else each block of elements to its owner by all_to_all
    in_place, ///< blocks, the owner reading its own values where they lie (host, MPI)
    combined, ///< one all_combine pass at every size (host, the thread group)
};

/// The exchange of a communicator: combined where it has all_combine, in place where it has
/// all_to_all_others (both on the host only), else blocks.
template <class Communicator>
inline constexpr anchored_exchange anchored_exchange_for =
    !Communicator::system_type::is_host            ? anchored_exchange::blocks
    : combine_communicator<Communicator>           ? anchored_exchange::combined
    : all_to_all_others_communicator<Communicator> ? anchored_exchange::in_place
                                                   : anchored_exchange::blocks;

/// Order-independent sums (kernels/anchored_sum.hpp) of n gradient elements and one loss over the
/// replicas of a communicator, on System. Per step: begin(); per chunk take() in parts, add() and
/// add_loss() (the chunks wait in an anchored_keeper); exchange(), check_local() and finalize()
/// (collective). Each element's sum is formed from all of its values in one place and rounded
/// once, so the bits depend neither on the replica count nor on the exchange:
/// - gathered when replicas x max_calls x n <= gather_values: one all_gather of every replica's
///   region of recv_ (its chunks, then its row), every element summed on every replica;
/// - combined: finalize() sums each replica's share of the elements from every replica's chunks
///   where they lie into every replica's g in one all_combine pass;
/// - blocks, in place: one block of elements per replica (the n mod replicas tail summed on every
///   replica): one all_to_all per call index brings every replica's values of this replica's
///   block here (in place: the owner's own stay where they lie); finalize() sums the block and
///   all-gathers the blocks.
/// Not gathered, finalize() then all-gathers every replica's row (anchored_row: its loss terms,
/// tail values and report). On the host the sums report this replica's non-finite values and
/// whether every sum is finite (own_report(), sums_finite()); on a device check_local() marks
/// them in g.
template <class T, class System, anchored_exchange Exchange = anchored_exchange::blocks>
class anchored_accumulator {
    static constexpr bool combined = Exchange == anchored_exchange::combined;
    static constexpr bool in_place = Exchange == anchored_exchange::in_place;
    static_assert(System::is_host || Exchange == anchored_exchange::blocks,
                  "the combined and in-place exchanges read the chunks on the host");
    using sum_fn = kernels::anchored_sum_fn<T>;

public:
    anchored_accumulator(std::size_t n, int replicas, int rank, const System& sys,
                         std::size_t gather_values = 0)
        : n_(n), replicas_(static_cast<std::size_t>(replicas)), gather_values_(gather_values),
          rank_(static_cast<std::size_t>(rank)), block_(n / replicas_),
          tail_(n - block_ * replicas_), sys_(sys), losses_(1, sys), own_report_(1, sys),
          keeper_(n, rank, sys) {}

    std::size_t size() const noexcept { return n_; }
    double* chunk_loss() noexcept { return &losses_.data()->chunk; }
    double* global_loss() noexcept { return &losses_.data()->global; }

    /// Starts a step in which this replica adds `calls` chunks and the busiest replica
    /// max_calls. requires: 1 <= calls <= max_calls, the same max_calls on every replica.
    void begin(std::size_t calls, std::size_t max_calls) {
        max_calls_ = max_calls;
        losses_added_ = 0;
        gathered_ = !combined && n_ > 0 && replicas_ * max_calls <= gather_values_ / n_;
        row_ = {max_calls,
                gathered_ || combined
                    ? 0
                    : (max_calls * tail_ * sizeof(T) + sizeof(double) - 1) / sizeof(double),
                reports_own() ? kernels::detail::anchored_combine_report::words_for(replicas_) : 0};
        if (gathered_) {
            // This replica's region: its chunks, padding up to a double's boundary (one float
            // when the chunk values are odd in number), then its row (doubles).
            row_at_ = (max_calls * n_ * sizeof(T) + sizeof(double) - 1) / sizeof(double) *
                      sizeof(double) / sizeof(T);
            region_ = row_at_ + row_.size() * sizeof(double) / sizeof(T);
            grow(recv_, replicas_ * region_);
            zero(sys_, recv_.span().subspan(rank_ * region_ + calls * n_,
                                            row_at_ - calls * n_)); // zeros past its calls
        } else {
            if (!combined)
                grow(recv_, max_calls * blocks());
            grow(small_send_, row_.size());
            grow(small_recv_, row_.size() * replicas_);
            if (calls < max_calls && n_ > zeros_.size()) {
                zeros_ = buffer<T, System>(n_, sys_);
                zero(sys_, zeros_.span());
            }
        }
        // The gathered exchange keeps the chunks in this replica's region.
        keeper_.begin(calls, gathered_ ? region(rank_) : nullptr, gathered_);
        zero(sys_, std::span<double>(own_row(), row_.size()));
    }
    /// anchored_keeper's passes: elements of the chunk being computed final in g; its end.
    void take(std::span<T> g, std::size_t first, std::size_t n) { keeper_.take(g, first, n); }
    void add(std::span<const T> g) { keeper_.add(g); }
    /// Adds one chunk's loss: `value` plus *device_value when not null (the system's memory).
    void add_loss(double value, const double* device_value) {
        run(1, loss_terms_fn{device_value, value, own_row() + 2 * losses_added_});
        ++losses_added_;
    }
    /// Gathered: every replica's region to every replica. Blocks: every replica's values of this
    /// replica's block here, and this replica's tail values into its row. Combined: nothing
    /// (finalize() moves it all). last: the last chunk's gradient. Collective.
    template <class Communicator>
    void exchange(Communicator& comm, std::span<const T> last) {
        static_assert(Exchange == anchored_exchange_for<Communicator>,
                      "the accumulator's exchange is the one its communicator type calls for");
        if (gathered_) { // the chunks and the rows of every replica, in place
            comm.all_gather(std::span<const T>(region(rank_), region_),
                            recv_.span().first(region_ * replicas_));
            return;
        }
        if constexpr (combined)
            return;
        const std::size_t all = blocks();
        if (block_ > 0)
            for (std::size_t c = 0; c < max_calls_; ++c) {
                const std::span<const T> src(own_chunk(c, last.data()), all);
                const std::span<T> got = recv_.span().subspan(c * all, all);
                if constexpr (in_place)
                    comm.all_to_all_others(src, got); // this replica's block read where it lies
                else
                    comm.all_to_all(src, got);
            }
        if (tail_ > 0)
            run(max_calls_ * tail_,
                anchored_tail_fn<T>{keeper_.chunks(last.data()), all, tail_,
                                    row_.tail_values<T>(own_row())},
                max_calls_ * tail_);
    }
    /// g (the last chunk's gradient) becomes a quiet NaN where a kept chunk of this replica
    /// holds a non-finite value (kernels::anchored_own_check_fn), so it is non-finite exactly
    /// where one of the replica's chunk values is; the global sums do not change (such an
    /// element's sum is a quiet NaN); where the sums report (reports_own()), g is left as it is.
    void check_local(std::span<T> g) {
        if (keeper_.calls() > 1 && !reports_own())
            run(n_, kernels::anchored_own_check_fn<T>{keeper_.chunks(g.data()), g.data()},
                keeper_.calls() * n_);
    }
    /// After exchange(): the global sums, rounded once, into g (n values) and *global_loss();
    /// where the sums report, own_report() this replica's own check. Collective.
    template <class Communicator>
    void finalize(Communicator& comm, std::span<T> g) {
        const std::size_t all = blocks();
        if (gathered_) {
            if constexpr (System::is_host) // every element here: this replica's report alone
                sum_reporting([&](std::size_t j, std::size_t c) { return region(j) + c * n_; }, n_,
                              g.data(), 0);
            else
                run(n_, sum_fn{{recv_.data(), replicas_, max_calls_, region_, n_}, g.data()});
        } else if constexpr (combined) {
            combine(comm, g);
        } else if (block_ > 0) { // this replica's block summed, then every block to every replica
            T* mine = g.data() + rank_ * block_;
            if constexpr (System::is_host) // in place: this replica's own where they lie
                sum_reporting(
                    [&](std::size_t j, std::size_t c) {
                        return in_place && j == rank_ ? own_chunk(c, g.data()) + rank_ * block_
                                                      : recv_.data() + c * all + j * block_;
                    },
                    block_, mine, rank_ * block_);
            else
                run(block_, sum_fn{{recv_.data(), replicas_, max_calls_, block_, all}, mine});
            comm.all_gather(std::span<const T>(mine, block_), g.first(all));
        }
        // Every replica's row (gathered: in its region), after the sums wrote the reports.
        const double* rows = gathered_ ? terms_of(0) : small_recv_.data();
        const std::size_t stride = gathered_ ? region_ * sizeof(T) / sizeof(double) : row_.size();
        if (!gathered_)
            comm.all_gather(std::span<const double>(small_send_.data(), row_.size()),
                            small_recv_.span().first(row_.size() * replicas_));
        if (row_.tail > 0) // the blocks' tail, summed here from every replica's tail values
            run(tail_,
                sum_fn{{row_.tail_values<T>(small_recv_.data()), replicas_, max_calls_,
                        row_.size() * sizeof(double) / sizeof(T), tail_},
                       g.data() + all},
                tail_ * replicas_ * max_calls_);
        if constexpr (reports_own()) // gathered: this replica's report covers every element
            run(1, own_report_fn<T>{row_.report_words(gathered_ ? own_row() : small_recv_.data()),
                                    gathered_ ? 1 : replicas_, row_, rank_,
                                    row_.tail_values<T>(own_row()), row_.tail > 0 ? tail_ : 0, all,
                                    g.data() + all, own_report_.data()});
        // Every replica's loss terms, summed as the gradient's elements are.
        run(1, kernels::anchored_sum_fn<double>{{rows, replicas_, row_.terms(), stride, 1},
                                                global_loss()});
    }
    /// After finalize(): adds status_loss_fn's loss (the global one where `first`, plus this
    /// replica's non-finite loss terms) to *loss.
    void add_status_loss(double* loss, bool first) {
        run(1, status_loss_fn{own_row(), 2 * losses_added_, global_loss(), first, loss});
    }
    /// Whether finalize() reports this replica's own check and the sums' finiteness
    /// (own_report(), sums_finite()) instead of check_local() marking g for it: on the host.
    static constexpr bool reports_own() noexcept { return System::is_host; }
    /// After finalize(), where reports_own(): this replica's own check in System's memory (its
    /// chunk values' non-finite count and first index, as a check of g after check_local would
    /// count them) and whether every sum is finite.
    const anchored_own_report* own_report() const noexcept { return own_report_.data(); }
    /// After finalize(): true when the sums reported that every one of them is finite, so a
    /// check of g as finalize() left it would count nothing; false on a device, or one is not.
    bool sums_finite() const { return reports_own() && own_report_.data()->sums_finite; }
    /// The collectives of a step.
    std::size_t collectives() const noexcept {
        return gathered_ ? 1 : combined ? 2 : (block_ > 0 ? max_calls_ + 1 : 0) + 1;
    }

private:
    template <class F>
    void run(std::size_t count, const F& f,
             std::size_t elements = std::numeric_limits<std::size_t>::max()) {
        kernels::for_each_index(sys_, count, f, elements);
    }
    /// The host's sums: out[i] = the rounded sum of element i of every replica's max_calls
    /// chunks (replica j's chunk c at at(j, c)), for i < count, tile by tile through a buffer on
    /// the stack as all_combine's pass (so out may be one of the chunks), reporting (base: the
    /// flat index of out[0]).
    template <class At>
    void sum_reporting(const At& at, std::size_t count, T* out, std::size_t base) {
        std::vector<const T*> sources(replicas_ * max_calls_);
        for (std::size_t j = 0; j < replicas_; ++j)
            for (std::size_t c = 0; c < max_calls_; ++c)
                sources[j * max_calls_ + c] = at(j, c);
        T* const to[1] = {out};
        combine_in_place(sys_, std::span<const T* const>(sources), std::span<T* const>(to), 0,
                         count, reporting(base));
    }
    /// combined: g = the sums of every replica's max_calls chunks (this replica's: its kept
    /// chunks, then g itself; zeros past its calls), by all_combine.
    template <class Communicator>
    void combine(Communicator& comm, std::span<T> g) {
        std::vector<const T*> arrays(max_calls_);
        for (std::size_t c = 0; c < max_calls_; ++c)
            arrays[c] = own_chunk(c, g.data());
        comm.all_combine(std::span<const T* const>(arrays), n_, g.first(n_), reporting(0));
    }
    /// The sums' functor, reporting into this replica's row, every replica's max_calls chunks a
    /// group; base: the flat index of its element 0.
    kernels::detail::anchored_combine_fn<T> reporting(std::size_t base) noexcept {
        return {{row_.report_words(own_row()), replicas_, max_calls_, base}};
    }
    template <class U>
    void grow(buffer<U, System>& b, std::size_t count) {
        if (b.size() < count)
            b = buffer<U, System>(count, sys_);
    }
    std::size_t blocks() const noexcept { return block_ * replicas_; }
    /// This replica's chunk c in the blocks and combined exchanges: kept, the last (`last`), or
    /// zeros past its calls.
    const T* own_chunk(std::size_t c, const T* last) const noexcept {
        const kernels::anchored_chunks<T> k = keeper_.chunks(last);
        return c + 1 < k.count ? k.stored + c * k.stride : c + 1 == k.count ? last : zeros_.data();
    }
    /// Gathered: replica j's region of recv_ (its chunks, then its row).
    T* region(std::size_t j) noexcept { return recv_.data() + j * region_; }
    /// Gathered: replica j's row, in its region of recv_ (written and read as doubles only; the
    /// all_gather moves them as bytes).
    double* terms_of(std::size_t j) noexcept {
        return reinterpret_cast<double*>(region(j) + row_at_);
    }
    /// This replica's row: gathered in its region of recv_, else in small_send_.
    double* own_row() noexcept { return gathered_ ? terms_of(rank_) : small_send_.data(); }

    std::size_t n_;
    std::size_t replicas_;
    std::size_t gather_values_; ///< gathered exchange up to this many values
    std::size_t rank_;
    std::size_t block_; ///< elements per replica's block
    std::size_t tail_;  ///< elements past the blocks, summed on every replica
    System sys_;
    std::size_t max_calls_ = 1;
    bool gathered_ = false;
    std::size_t losses_added_ = 0;
    anchored_row row_;
    std::size_t row_at_ = 0; ///< gathered: where a replica's row starts in its region
    std::size_t region_ = 0; ///< gathered: values of T per replica (chunks, padding, row)
    buffer<anchored_losses, System> losses_;
    buffer<anchored_own_report, System> own_report_; ///< reports_own()
    buffer<T, System> recv_;            ///< what the exchange brings (gathered: and own chunks)
    buffer<T, System> zeros_;           ///< what a replica with fewer calls sends
    buffer<double, System> small_send_; ///< not gathered: this replica's row
    buffer<double, System> small_recv_; ///< not gathered: every replica's row
    anchored_keeper<T, System> keeper_; ///< where this replica's chunks wait for the exchange
};

} // namespace lockstep::detail
