// lockstep/comm/detail/shm_handle.hpp: what every operation of a thread_communicator stands
// on: its membership of the group, the publication and checked rendezvous that start each
// collective, the phases after it, failures that leave no peer waiting, and the flight recorder.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/collective_tag.hpp"
#include "lockstep/comm/communicator.hpp"
#include "lockstep/comm/detail/shm_group.hpp"
#include "lockstep/comm/detail/shm_sync.hpp"
#include "lockstep/comm/detail/shm_validate.hpp"
#include "lockstep/comm/detail/span_checks.hpp"
#include "lockstep/comm/flight_recorder.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/system/host_system.hpp"

#include <algorithm>
#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace lockstep::detail::shm {

/// One replica thread's handle on a group_state, the base of thread_communicator (whose
/// comment states what it guarantees): the rank and sequence numbers, the call record each
/// collective publishes (record), the rendezvous that checks every replica agrees (start), the
/// phases after it (next_phase), data phases whose exceptions leave no peer waiting (guarded)
/// and the flight recorder. thread_communicator adds the collectives and messages (the
/// reducing collectives through its base reduction_handle, shm_reductions.hpp).
class member_handle {
public:
    using system_type = host_system;

    member_handle(const member_handle&) = delete;
    member_handle& operator=(const member_handle&) = delete;

    /// This replica's rank in the group, 0 <= rank() < size().
    int rank() const noexcept { return rank_; }
    /// The number of replicas in the group.
    int size() const noexcept { return group_ ? group_->size() : 0; }
    /// This replica's index in the whole thread_group (equals rank() unless split).
    int replica() const noexcept { return group_ ? group_->replica_of(rank_) : -1; }
    /// The host system of this replica: the machine's hardware threads divided by the
    /// replicas of the whole thread_group.
    host_system system() const { return group_ ? group_->system() : host_system(); }
    /// True once any replica of the run has failed or the run was aborted
    /// (thread_group::abort). Replica code that computes for long between collectives can
    /// poll it and return early: lockstep cannot interrupt user code.
    bool run_failed() const noexcept { return group_ && group_->context().failed(); }
    /// The first failure of this handle's group (null when none): what the others' errors were
    /// caused by, e.g. for telling a lost replica from a deterministic error.
    std::exception_ptr run_failure() const {
        return group_ ? group_->context().root_failure() : nullptr;
    }
    /// This handle's record of its last collectives (see flight_recorder).
    const flight_recorder& trace() const noexcept { return trace_; }
    /// Records e, thrown on this replica, as the failure of its run (what thread_group::run
    /// rethrows and what the peers' errc::peer_failure names) unless one is recorded already;
    /// nothing on a moved-from handle. thread_group::run records a replica's exception once it
    /// leaves the replica's function: code that moves the handle into an object of its own
    /// (hierarchical_group) calls this from its handler while that object still holds the
    /// handle, since peers that find a destroyed handle missing record its departure instead.
    /// Like thread_group::run, it takes e as the run's failure in place of one the
    /// communicator raised on this replica when e has the same code (run_context::record_exit).
    void record_failure(const std::exception_ptr& e) {
        if (group_)
            group_->context().record_exit(replica(), e, describe(e));
    }

protected:
    member_handle(std::shared_ptr<group_state> group, int rank)
        : group_(std::move(group)), rank_(rank) {}
    /// Moves the handle, sequence numbers included. ensures: o is empty (size() == 0) and
    /// throws errc::invalid_argument from every communication call.
    member_handle(member_handle&& o) noexcept
        : group_(std::move(o.group_)), rank_(o.rank_), seq_(o.seq_), epoch_(o.epoch_),
          entry_waits_(o.entry_waits_), trace_(std::move(o.trace_)) {}
    /// Leaves this handle's group (as the destructor does), then takes o's handle.
    member_handle& operator=(member_handle&& o) noexcept {
        if (this != &o) {
            leave();
            group_ = std::move(o.group_);
            rank_ = o.rank_;
            seq_ = o.seq_;
            epoch_ = o.epoch_;
            entry_waits_ = o.entry_waits_;
            trace_ = std::move(o.trace_);
        }
        return *this;
    }
    /// Leaves the group: peers that wait for this replica afterwards throw errc::peer_failure.
    ~member_handle() { leave(); }

    struct session {
        std::uint64_t seq;
        std::uint64_t first; ///< epoch of the first phase
        int phases;
        int done;
        op_label op;
        flight_recorder::scope traced; ///< marks the recorded collective done or failed
        std::chrono::steady_clock::time_point began{}; ///< when this replica's data work began
        /// The epoch of the final phase (no data phase follows it).
        std::uint64_t last() const noexcept {
            return first + static_cast<std::uint64_t>(phases) - 1;
        }
    };

    void leave() noexcept {
        if (group_)
            group_->depart(rank_, std::uncaught_exceptions() > 0);
        group_.reset();
    }

    /// Refuses a moved-from handle, and one kept past the thread_group::run that made it (its
    /// peers are gone: a wait would only time out).
    void require_group(const char* op) const {
        LOCKSTEP_REQUIRE(group_ != nullptr, errc::invalid_argument, -1, op,
                         "this thread_communicator was moved from");
        if (group_->context().finished()) [[unlikely]]
            fail(errc::invalid_argument, replica(), op,
                 "the thread_group::run that made this handle has returned; a "
                 "thread_communicator is valid only inside thread_group::run's function (keep "
                 "neither it nor its splits past the run)");
    }

    /// Point-to-point spans are checked here, before anything is copied (no peer waits on
    /// this call, so a local error is enough).
    template <class T>
    void require_span(const std::string& op, std::span<T> data) const {
        const std::string problem = lockstep::detail::span_problem(data, "data");
        LOCKSTEP_REQUIRE(problem.empty(), errc::invalid_argument, replica(), op, problem);
    }

    template <class T>
    call_record record(collective_kind kind, std::size_t count, std::size_t recv_count,
                       const void* send, void* recv, reduce_op op, int root,
                       collective_tag tag = {}) const {
        call_record r;
        const bool sites = group_ && group_->context().check_call_sites();
        r.tag = tag.identity(sites);
        r.tag_is_site = tag.by_site(sites);
        r.kind = kind;
        r.type = element_type_of<T>();
        r.elem_size = sizeof(T);
        r.count = count;
        r.recv_count = recv_count;
        r.op = op;
        r.root = root;
        r.send = send;
        r.recv = recv;
        return r;
    }

    /// Publishes the call, passes the first phase and checks that all replicas agree.
    /// Small collectives copy `stash_count` elements from `stash` into this replica's stash.
    template <class T = char>
    session start(call_record rec, int phases, const T* stash = nullptr,
                  std::size_t stash_count = 0) {
        require_group(name_of(rec.kind));
        // A replica's bad spans become an error on every replica (validate) and nothing is
        // copied from them.
        rec.problem = record_problem(rec);
        if (!rec.problem.empty()) {
            stash = nullptr;
            stash_count = 0;
        }
        const std::uint64_t seq = seq_++;
        const bool rooted =
            rec.kind == collective_kind::broadcast || rec.kind == collective_kind::reduce;
        session s{seq,
                  epoch_ + 1,
                  phases,
                  0,
                  {name_of(rec.kind), seq},
                  {trace_,
                   trace_.record(name_of(rec.kind), seq, trace_type(rec.type), rec.count,
                                 rooted ? rec.root : -1),
                   seq}};
        if (const auto& hook = group_->context().hook())
            hook({collective_event::moment::entered, replica(), rank_,
                  group_->context().generation(), seq, name_of(rec.kind), group_->label(),
                  rec.tag});
        try {
            group_->throw_if_failed(rank_, s.op);
            group_->publish(rank_, seq, std::move(rec), stash, stash_count * sizeof(T));
            const auto arrived = std::chrono::steady_clock::now();
            next_phase_untraced(s, group_->context().entry_spin(entry_waits_));
            entry_waits_.record(std::chrono::steady_clock::now() - arrived,
                                run_context::max_entry_spin);
            validate_calls(*group_, rank_, s.op);
        } catch (const error& e) {
            throw_traced(e);
        }
        s.began = std::chrono::steady_clock::now();
        return s;
    }

    /// After a data phase: waits for the peers doing theirs, spinning about as long as this
    /// replica's took (run_context::data_phase_spin) before it sleeps.
    void next_phase(session& s) {
        const auto now = std::chrono::steady_clock::now();
        const auto spin = group_->context().data_phase_spin(now - s.began);
        try {
            next_phase_untraced(s, spin);
        } catch (const error& e) {
            throw_traced(e);
        }
        s.began = std::chrono::steady_clock::now();
    }
    void next_phase_untraced(session& s,
                             std::chrono::nanoseconds spin = std::chrono::nanoseconds(0)) {
        ++s.done;
        ++epoch_;
        group_->arrive_and_wait(rank_, epoch_, s.first, s.last(), s.op, spin);
    }

    /// Called from a handler of e: writes the flight recorder for the errors it is kept for
    /// and throws e again, naming the file.
    [[noreturn]] void throw_traced(const error& e) {
        trace_.fail_newest();
        if (!flight_recorder::dumps_on(e.code()))
            throw;
        throw flight_recorder::with_trace(
            e, trace_.dump(replica(), size(), e.what(), group_->label()));
    }

    static const char* trace_type(element_type t) noexcept {
        using et = element_type;
        switch (t) {
        case et::int8:
            return "int8";
        case et::uint8:
            return "uint8";
        case et::int16:
            return "int16";
        case et::uint16:
            return "uint16";
        case et::int32:
            return "int32";
        case et::uint32:
            return "uint32";
        case et::int64:
            return "int64";
        case et::uint64:
            return "uint64";
        case et::float32:
            return "float32";
        case et::float64:
            return "float64";
        case et::float16:
            return "float16";
        case et::bfloat16:
            return "bfloat16";
        case et::bytes:
            return "bytes";
        }
        return "bytes";
    }

    /// Runs a data phase that may throw (kernels through Thrust); an exception leaves the
    /// collective without leaving peers waiting for, or reading from, this replica.
    template <class F>
    void guarded(const session& s, F&& data_phase) {
        try {
            data_phase();
        } catch (...) {
            group_->abandon_current(rank_, s.first, s.last(), std::current_exception());
        }
    }

    /// Whether `count` elements of T go through the stash (one phase).
    template <class T>
    static constexpr bool stashed(std::size_t count) noexcept {
        return count <= stash_bytes / sizeof(T) && alignof(T) <= 64;
    }
    template <class T>
    const T* stashed_send(int j, const session& s) const {
        return reinterpret_cast<const T*>(group_->stash(j, s.seq));
    }

    template <class T>
    const T* peer_send(int j, const session& s) const {
        return static_cast<const T*>(group_->call(j, s.seq).send);
    }
    template <class T>
    T* peer_recv(int j, const session& s) const {
        return static_cast<T*>(group_->call(j, s.seq).recv);
    }

    /// One pointer per replica (the peers' send or recv spans), on the stack for the usual
    /// small groups.
    template <class P>
    class pointer_list {
    public:
        explicit pointer_list(int n) {
            if (n > static_cast<int>(local_.size()))
                heap_.resize(static_cast<std::size_t>(n));
        }
        P& operator[](int j) noexcept { return data()[j]; }
        P* data() noexcept { return heap_.empty() ? local_.data() : heap_.data(); }

    private:
        std::array<P, 16> local_{};
        std::vector<P> heap_;
    };
    template <class T>
    using source_list = pointer_list<const T*>;
    template <class T>
    using dest_list = pointer_list<T*>;

    template <class T>
    static void copy_elements(T* dst, const T* src, std::size_t n) {
        if (n != 0 && dst != src)
            std::memcpy(dst, src, n * sizeof(T));
    }

    std::shared_ptr<group_state> group_;
    int rank_ = 0;
    std::uint64_t seq_ = 0;                       ///< collectives this handle has started
    std::uint64_t epoch_ = 0;                     ///< phases this handle has arrived at
    lockstep::detail::wait_estimate entry_waits_; ///< how long its collectives' entries wait
    flight_recorder trace_{"thread"};
};

} // namespace lockstep::detail::shm
