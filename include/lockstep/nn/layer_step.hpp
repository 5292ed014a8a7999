// lockstep/nn/layer_step.hpp: layer_step, what a trainer's step hands the layers of the user's
// network (where device-side errors go, the skip flag, the layers to commit, the layers' host
// counters, the state they keep), and step_participant, a layer that keeps or restores its state
// when the step's fate is known.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/kernels/layer_report.hpp"

#include <atomic>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace lockstep::nn {

/// A layer whose state changes in a step's forward pass (batch-norm running statistics) before
/// the trainer knows whether the step is applied. The trainer calls commit_step once per step,
/// after its skip decision, on the replica's thread and stream: `skip` is the decision in the
/// system's memory (an int, 1: skipped), for kernels that restore the state on the device.
class step_participant {
public:
    virtual void commit_step(const int* skip) = 0;

protected:
    step_participant() = default;
    step_participant(const step_participant&) = default;
    step_participant& operator=(const step_participant&) = default;
    ~step_participant() = default;
};

/// A layer's host counter (e.g. batch_norm::num_batches_tracked) and what one step added to it.
/// A step captured into a CUDA graph runs no host code on its launches: the trainer adds `added`
/// to `*counter` once per launch (data_parallel::count_replay).
struct step_count {
    std::int64_t* counter;
    std::int64_t added;
};

/// State a layer of a step keeps in memory of its own (batch-norm running statistics), which a
/// checkpoint must carry: the layer's number in forward order in the step, its kind (e.g. the
/// policy's name, by a function), its channels, the memory (in the system's memory) and its element
/// size.
struct layer_state {
    int layer;
    std::string (*kind)();
    std::size_t channels;
    const void* data;
    std::size_t bytes;
    std::size_t element_bytes;
};

/// One training step as the layers see it. A trainer owns it for its lifetime, resets it at the
/// start of every step (begin) and passes it through replica_context::layer_step(); a layer
/// called outside a trainer's step gets none and checks its own status at once.
class layer_step {
public:
    /// Starts a step, with an id() no other step of the process had: the layers report into
    /// `first`/`errors` (device memory of the step's state) and the skip decision is read at
    /// `skip`. `ghost_global`: the global batch of a reduce::reproducible step (bn::ghost layers
    /// gather every replica's chunks at its end), 0 in other steps. `captured`: the step is
    /// recorded into a CUDA graph, not run (count() records without adding).
    void begin(kernels::layer_error_record* first, double* errors, const int* skip,
               std::size_t ghost_global, bool captured = false) {
        static std::atomic<std::uint64_t> ids{0};
        id_ = ids.fetch_add(1, std::memory_order_relaxed) + 1;
        first_ = first;
        errors_ = errors;
        skip_ = skip;
        ghost_global_ = ghost_global;
        captured_ = captured;
        layers_ = 0;
        participants_.clear();
        counts_.clear();
        kept_.clear();
    }

    /// Where the next layer in forward order reports (its number is its order in this step).
    kernels::layer_report next_report() noexcept {
        return kernels::layer_report{first_, errors_, static_cast<double>(layers_++)};
    }
    /// The number the next layer in forward order gets from next_report().
    int next_layer() const noexcept { return layers_; }
    /// p's commit_step runs after the skip decision of this step. requires: p outlives the step.
    void join(step_participant& p) { participants_.push_back(&p); }
    /// For the trainer, after the skip decision: every participant commits, once.
    void commit() {
        for (step_participant* p : participants_)
            p->commit_step(skip_);
        participants_.clear();
    }

    /// A layer's host counter grows by n in this step: `counter += n` at once, and recorded
    /// (counts()); in a captured step only recorded, since the capture is not a step: each
    /// launch of the graph adds the recorded amounts (data_parallel::count_replay). requires:
    /// counter stays at its address while a graph of this step is launched (a member of a layer
    /// of the trainer's network).
    void count(std::int64_t& counter, std::int64_t n) {
        if (!captured_)
            counter += n;
        for (step_count& c : counts_)
            if (c.counter == &counter) {
                c.added += n;
                return;
            }
        counts_.push_back({&counter, n});
    }
    /// A layer of this step keeps state of its own (once per layer and step).
    void keeps(const layer_state& s) { kept_.push_back(s); }
    /// The state the layers of this step (the last one, between steps) keep, in forward order.
    const std::vector<layer_state>& kept() const noexcept { return kept_; }
    /// What the layers counted in this step, one entry per counter.
    const std::vector<step_count>& counts() const noexcept { return counts_; }

    std::uint64_t id() const noexcept { return id_; }
    std::size_t ghost_global() const noexcept { return ghost_global_; }

    /// The step whose step function the calling thread is running now (set by the trainer's
    /// running_scope), or null. Read only to refuse a call that bypasses the step: a layer given
    /// a bare communicator has nothing else to tell it that a step is running (a communicator,
    /// user-defined ones included, has no place for the step), and a trainer runs the step
    /// function on the replica's own thread.
    static const layer_step* running() noexcept { return running_slot(); }
    /// For trainers: marks the calling thread as running `step`'s step function for the
    /// scope's lifetime (the previous mark is restored after it, also on a throw).
    class running_scope {
    public:
        explicit running_scope(const layer_step* step) noexcept : previous_(running_slot()) {
            running_slot() = step;
        }
        running_scope(const running_scope&) = delete;
        running_scope& operator=(const running_scope&) = delete;
        ~running_scope() { running_slot() = previous_; }

    private:
        const layer_step* previous_;
    };

private:
    static const layer_step*& running_slot() noexcept {
        thread_local const layer_step* step = nullptr;
        return step;
    }

    std::uint64_t id_ = 0;
    kernels::layer_error_record* first_ = nullptr;
    double* errors_ = nullptr;
    const int* skip_ = nullptr;
    std::size_t ghost_global_ = 0;
    bool captured_ = false;
    int layers_ = 0;
    std::vector<step_participant*> participants_;
    std::vector<step_count> counts_;
    std::vector<layer_state> kept_;
};

class policy_declaration; // nn/policy_declaration.hpp

/// What a layer's training calls accept besides a bare communicator: an object that gives the
/// communicator, the step being run and the trainer's policy declaration
/// (lockstep::replica_context).
template <class Ctx>
concept layer_context = requires(Ctx& c) {
    c.comm();
    { c.layer_step() } -> std::convertible_to<layer_step*>;
    { c.policies() } -> std::convertible_to<const policy_declaration*>;
};

} // namespace lockstep::nn
