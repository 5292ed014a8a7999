// lockstep/train/detail/bucketed_collective.hpp: piecewise_collective, a gradient reduced in
// pieces (buckets) launched in plan order as backward marks their tensors ready, and the
// collectives of reduce::per_tensor and reduce::bucketed (one in-place all_reduce per piece).
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/comm_stream.hpp"
#include "lockstep/comm/communicator.hpp"
#include "lockstep/policy/reduce.hpp"
#include "lockstep/train/detail/bucket_plan.hpp"
#include "lockstep/train/detail/gradient_collective.hpp"
#include "lockstep/train/detail/reduce_functors.hpp"
#include "lockstep/train/detail/step_checks.hpp"
#include "lockstep/train/parameter_registry.hpp"
#include "lockstep/train/train_params.hpp"

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace lockstep::detail {

/// A collective (gradient_collective.hpp) that reduces the flat gradient in pieces while
/// backward runs: each piece of the plan is launched, in plan order, as soon as backward has
/// marked every tensor of it and of the pieces before it ready (ordered_launcher), right after
/// its NaN/inf check (its own values: the row names this replica); the rest at the end. Pieces
/// run inline on the replica's communicator, or on its comm_stream with overlap. The update
/// runs on every replica over every element. Derived supplies `reduce_piece(Communicator& c,
/// std::span<T> piece)` (or `reduce_piece(c, piece, const bucket& b)`, b the element of plan()):
/// the collective(s) that sum one piece over c (run with c's system for its kernels; returning
/// void for one collective, or the number it issued), and overrides reduced_here, agree, update
/// and average where its policy differs. Every replica issues the same collectives in the same
/// order, whatever it marks ready. On a host system a piece launched while backward runs is
/// digested once its reduction is done, and again after fn returns: a gradient written after
/// its tensor was marked ready (it would be lost, or reduced on some replicas only) throws.
template <class Derived, class T, class Communicator>
class piecewise_collective {
public:
    using system_type = typename Communicator::system_type;
    static constexpr std::size_t status_doubles = 0;

    piecewise_collective(Communicator& comm, std::vector<bucket> plan, std::size_t tensors,
                         overlap_setting overlap)
        : comm_(&comm), launcher_(std::move(plan), tensors, comm.rank()),
          launched_digest_(launcher_.plan().size()), launched_early_(launcher_.plan().size()) {
        if (overlap.enabled)
            stream_.emplace(comm, overlap.priority);
    }

    /// The gradient of the step: zeroed, then fn over this replica's part of every micro-batch
    /// (the stages' forward_backward), with the ready hook launching each piece as its tensors
    /// are final; then the network's gradients packed (visitor networks), every piece not yet
    /// launched launched, and the communication joined (on CUDA: the compute stream waits).
    /// On a host system, a piece launched during fn whose values changed after its reduction
    /// (fn wrote a gradient after marking its tensor ready) throws lockstep::error
    /// (invalid_argument) on this replica, naming its tensors; its peers then fail as when fn
    /// throws.
    template <class Stages, class Fn>
    double gradient(Stages& s, std::size_t global, Fn& fn) {
        s.begin(0);
        s.zero();
        begin(s.core().grads(), &s.checks());
        in_backward_ = true;
        const double loss =
            s.forward_backward(global, fn, false, [this](std::size_t t) { mark_ready(t); });
        in_backward_ = false;
        s.pack_gradients();
        finish();
        check_unchanged(s.core().registry().parameters());
        return loss;
    }

    /// Every replica holds the reduced gradient.
    bool reduced_here(int /*rank*/) const noexcept { return true; }

    /// The reduced gradient checked over every element, then the status summed.
    template <class Stages>
    void agree(Stages& s) {
        s.check(s.core().optimizer_shard());
        s.sum_status();
    }

    /// Clipped and updated on every replica alike: the values stay equal.
    template <class Stages>
    void update(Stages& s) {
        update_every_element(s);
    }

    /// values = the mean over replicas (local SGD): the pieces reduced, then scaled.
    void average(std::span<T> values) {
        begin(values);
        finish();
        scale(comm_->system(), values, T(1) / static_cast<T>(comm_->size()));
    }

    // --- the pieces ---

    /// Starts the reduction of data (the flat gradient); nothing launched. With `checks`, each
    /// piece's NaN/inf count is taken right before it is launched (on CUDA it runs before the
    /// reduction, which waits for the caller's stream).
    void begin(std::span<T> data, gradient_checks<system_type>* checks = nullptr) {
        data_ = data;
        checks_ = checks;
        in_backward_ = false;
        std::fill(launched_early_.begin(), launched_early_.end(), char{0});
        launcher_.reset();
    }
    /// Tensor t of data is final: every piece now complete is launched, in order.
    void mark_ready(std::size_t t) {
        launcher_.mark_ready(t, [&](const bucket& b) { launch(b); });
    }
    /// Launches the rest and waits for every piece.
    void finish() {
        launcher_.finish([&](const bucket& b) { launch(b); });
        if (stream_)
            stream_->join();
    }

    const std::vector<bucket>& plan() const noexcept { return launcher_.plan(); }
    std::size_t collectives() const noexcept {
        return collectives_.load(std::memory_order_relaxed);
    }
    bool overlaps() const noexcept { return stream_.has_value(); }
    /// With overlap: submits fn(c) to the communication stream, after the items submitted
    /// before it, and returns true (drain() waits for it; fn must not throw); else false.
    template <class Fn>
    bool submit_to_stream(Fn&& fn) {
        if (!stream_)
            return false;
        stream_->submit(std::forward<Fn>(fn));
        return true;
    }
    void drain() noexcept {
        if (!stream_)
            return;
        try {
            stream_->join();
        } catch (...) {
        }
    }

protected:
    Communicator& comm() noexcept { return *comm_; }
    void count_collective() noexcept { collectives_.fetch_add(1, std::memory_order_relaxed); }

private:
    void launch(const bucket& b) {
        if (checks_ != nullptr)
            checks_->check_piece(comm_->system(), std::span<const T>(data_),
                                 static_cast<std::size_t>(&b - launcher_.plan().data()), b);
        const std::span<T> piece = data_.subspan(b.offset, b.size);
        const auto k = static_cast<std::size_t>(&b - launcher_.plan().data());
        const bool watch = system_type::is_host && in_backward_;
        launched_early_[k] = watch ? 1 : 0;
        if (stream_) {
            stream_->submit([this, piece, pb = &b, k, watch](Communicator& c) {
                reduce(c, piece, *pb);
                if (watch)
                    launched_digest_[k] = digest(piece); // read after join()
            });
        } else {
            reduce(*comm_, piece, b);
            if (watch)
                launched_digest_[k] = digest(piece);
        }
    }
    /// A digest of a piece in host memory, at the cost of one read: Fletcher's two sums of its
    /// 64-bit words (the sum, and the sum of the running sums, which weighs each word by its
    /// position) and their XOR. One changed word always changes the sum; values moved to other
    /// positions (a transposed gradient) change the weighted sum; writes that cancel in all
    /// three would have to be chosen for it.
    static std::uint64_t digest(std::span<const T> piece) noexcept {
        const auto* bytes = reinterpret_cast<const unsigned char*>(piece.data());
        const std::size_t n = piece.size_bytes();
        std::uint64_t sum = 0, weighted = 0, x = 0;
        std::size_t i = 0;
        for (; i + 8 <= n; i += 8) {
            std::uint64_t w;
            std::memcpy(&w, bytes + i, 8);
            sum += w;
            weighted += sum;
            x ^= w;
        }
        for (; i < n; ++i) {
            sum += bytes[i];
            weighted += sum;
            x ^= std::uint64_t(bytes[i]) << (8 * (i % 8));
        }
        return sum ^ (weighted * 0xc2b2ae3d27d4eb4full) ^ (x * 0x9e3779b97f4a7c15ull);
    }
    /// After finish(): every piece launched during fn still holds what its reduction left.
    void check_unchanged(const std::vector<tensor_info>& tensors) const {
        if constexpr (system_type::is_host) {
            std::string changed;
            const auto& plan = launcher_.plan();
            for (std::size_t k = 0; k < plan.size(); ++k) {
                if (launched_early_[k] == 0 ||
                    digest(std::span<const T>(data_.subspan(plan[k].offset, plan[k].size))) ==
                        launched_digest_[k])
                    continue;
                for (std::size_t t = plan[k].first_tensor; t <= plan[k].last_tensor; ++t)
                    changed += (changed.empty() ? "'" : ", '") + tensors[t].name + "'";
            }
            if (!changed.empty())
                fail(errc::invalid_argument, comm_->rank(), "data_parallel.step",
                     "the gradient of ", changed,
                     " (one reduction piece) changed after ctx.mark_ready launched its "
                     "reduction: fn wrote it after marking it ready, so the write would be lost "
                     "or summed on some replicas only; call mark_ready once backward has "
                     "finished writing the tensor (e.g. after the last use of a shared weight)");
        }
    }
    void reduce(Communicator& c, std::span<T> piece, const bucket& b) {
        Derived& self = static_cast<Derived&>(*this);
        const auto run = [&] {
            if constexpr (requires { self.reduce_piece(c, piece, b); })
                return self.reduce_piece(c, piece, b);
            else
                return self.reduce_piece(c, piece);
        };
        if constexpr (std::is_void_v<decltype(run())>) {
            run();
            collectives_.fetch_add(1, std::memory_order_relaxed);
        } else {
            collectives_.fetch_add(run(), std::memory_order_relaxed);
        }
    }

    Communicator* comm_;
    ordered_launcher launcher_;
    std::vector<std::uint64_t> launched_digest_; ///< per piece: its digest once reduced
    std::vector<char> launched_early_;           ///< per piece: launched during fn (watched)
    bool in_backward_ = false;                   ///< fn is running (gradient())
    std::span<T> data_;
    gradient_checks<system_type>* checks_ = nullptr;
    std::atomic<std::size_t> collectives_{0}; // the communication thread adds to it
    std::optional<comm_stream<Communicator>> stream_;
};

/// reduce::bucketed<Bytes, FirstBytes>: buckets of ~Bytes (the first ~FirstBytes), each summed by
/// one in-place all_reduce.
template <std::size_t Bytes, std::size_t FirstBytes, class T, class Communicator>
class collective<reduce::bucketed<Bytes, FirstBytes>, T, Communicator>
    : public piecewise_collective<collective<reduce::bucketed<Bytes, FirstBytes>, T, Communicator>,
                                  T, Communicator> {
    using policy = reduce::bucketed<Bytes, FirstBytes>;
    using base = piecewise_collective<collective, T, Communicator>;

public:
    collective(Communicator& comm, const std::vector<tensor_info>& tensors,
               overlap_setting overlap = {}, const train_params& /*params*/ = {})
        : base(comm, plan_buckets_of<policy>(tensors, sizeof(T)), tensors.size(), overlap) {}

    void reduce_piece(Communicator& c, std::span<T> piece) {
        c.all_reduce(std::span<const T>(piece), piece, reduce_op::sum);
    }
};

/// reduce::per_tensor: every tensor its own piece (reduce::bucketed with one-byte buckets).
template <class T, class Communicator>
class collective<reduce::per_tensor, T, Communicator>
    : public collective<reduce::bucketed<1, 1>, T, Communicator> {
public:
    using collective<reduce::bucketed<1, 1>, T, Communicator>::collective;
};

} // namespace lockstep::detail
