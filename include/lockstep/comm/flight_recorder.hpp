// lockstep/comm/flight_recorder.hpp: flight_recorder, a fixed-size ring of a communicator's
// last operations, written out when a collective fails. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/error.hpp"
#include "lockstep/core/float16.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(_WIN32)
#include <process.h>
#else
#include <unistd.h>
#endif

namespace lockstep {

/// Where a recorded operation stood when the ring was read.
enum class op_state : unsigned char { queued, running, done, failed };

/// "queued", "running", "done" or "failed".
constexpr const char* to_string(op_state s) noexcept {
    switch (s) {
    case op_state::queued:
        return "queued";
    case op_state::running:
        return "running";
    case op_state::done:
        return "done";
    case op_state::failed:
        return "failed";
    }
    return "?";
}

/// One recorded operation. Text fields point to static strings, so recording never allocates.
struct flight_entry {
    std::uint64_t seq = 0;   ///< the communicator's sequence number ("#n" in errors)
    const char* op = "";     ///< "all_reduce", "send", ...
    const char* type = "";   ///< element type, e.g. "float32"
    std::uint64_t count = 0; ///< elements per replica (send count)
    int peer = -1;           ///< root of a rooted collective, peer of send/recv, else -1
    op_state state = op_state::queued;
    std::int64_t start_ns = 0; ///< steady clock, ns since its epoch (as entries() gives it)
    std::int64_t end_ns = 0;   ///< 0 while queued or running
};

/// The element type name the recorder writes for T ("float32", "int64", "bytes", ...).
template <class T>
constexpr const char* trace_type_name() noexcept {
    using U = std::remove_cv_t<T>;
    if constexpr (std::is_same_v<U, float>)
        return "float32";
    else if constexpr (std::is_same_v<U, double>)
        return "float64";
    else if constexpr (std::is_same_v<U, half>)
        return "float16";
    else if constexpr (std::is_same_v<U, bfloat16>)
        return "bfloat16";
    else if constexpr (std::is_integral_v<U> && !std::is_same_v<U, bool>) {
        constexpr bool s = std::is_signed_v<U>;
        if constexpr (sizeof(U) == 1)
            return s ? "int8" : "uint8";
        else if constexpr (sizeof(U) == 2)
            return s ? "int16" : "uint16";
        else if constexpr (sizeof(U) == 4)
            return s ? "int32" : "uint32";
        else
            return s ? "int64" : "uint64";
    } else
        return "bytes";
}

/// The last K operations of one communicator handle (one replica), oldest overwritten first.
/// K comes from LOCKSTEP_TRACE_OPS (default 64; 0 turns recording off). The ring is allocated
/// once; record and finish write a few words and never allocate or lock (a handle is used by
/// one thread at a time, and so is its recorder).
///
/// On a timeout, a peer failure or a disagreement between replicas, the communicator calls
/// dump: it prints the last few operations to stderr and, when LOCKSTEP_TRACE_DIR is set,
/// writes the whole ring to $LOCKSTEP_TRACE_DIR/lockstep-trace.<label>.<pid>.<replica>.<id>.jsonl
/// (one JSON object per line: a header, then the operations oldest first), which
/// scripts/trace_merge.py merges across replicas. <id> numbers the recorders of the process
/// (id()), so handles of one replica (a group and its split) write files of their own.
class flight_recorder {
public:
    static constexpr std::size_t no_slot = static_cast<std::size_t>(-1);

    /// label names the backend in files ("thread", "mpi", "nccl", ...): a static string.
    explicit flight_recorder(const char* label = "comm", std::size_t capacity = env_capacity())
        : label_(label), ring_(capacity) {}

    /// LOCKSTEP_TRACE_OPS, or 64 when unset or not a number.
    static std::size_t env_capacity() {
        const char* s = std::getenv("LOCKSTEP_TRACE_OPS");
        if (s == nullptr || *s == '\0')
            return 64;
        char* end = nullptr;
        const unsigned long long v = std::strtoull(s, &end, 10);
        return end != nullptr && *end == '\0' ? static_cast<std::size_t>(v) : 64;
    }

    /// The ring's size K.
    std::size_t capacity() const noexcept { return ring_.size(); }
    /// The backend label given at construction.
    const char* label() const noexcept { return label_; }
    /// This recorder's number, unique in the process (a moved recorder keeps it): its files'
    /// names end in it.
    std::uint64_t id() const noexcept { return id_; }

    /// Records the start of an operation; returns its slot for finish (no_slot when K == 0).
    std::size_t record(const char* op, std::uint64_t seq, const char* type, std::uint64_t count,
                       int peer, op_state state = op_state::running) noexcept {
        const std::int64_t t = ticks();
        if (last_end_ != 0 && t > last_end_)
            between_ += t - last_end_;
        last_end_ = t; // an operation queued before the last one ended counts from its start
        if (ring_.empty())
            return no_slot;
        const std::size_t slot = static_cast<std::size_t>(recorded_++ % ring_.size());
        ring_[slot] = flight_entry{seq, op, type, count, peer, state, t, 0};
        return slot;
    }

    /// Sets the state of the operation in `slot` (its end time too, for done and failed),
    /// unless the ring has moved past it since.
    void finish(std::size_t slot, std::uint64_t seq, op_state state) noexcept {
        const bool ended = state == op_state::done || state == op_state::failed;
        const std::int64_t t = ended ? ticks() : 0;
        last_end_ = std::max(last_end_, t);
        if (slot >= ring_.size() || ring_[slot].seq != seq)
            return;
        ring_[slot].state = state;
        if (ended)
            ring_[slot].end_ns = t;
    }
    /// Marks every queued operation done, now (an asynchronous backend whose stream went idle).
    void complete_queued() noexcept {
        const std::int64_t now = ticks();
        last_end_ = std::max(last_end_, now);
        for (auto& e : ring_)
            if (e.state == op_state::queued) {
                e.state = op_state::done;
                e.end_ns = now;
            }
    }
    /// Marks the newest operation failed (if it has not ended): the one an error comes from.
    void fail_newest() noexcept {
        if (recorded_ == 0 || ring_.empty())
            return;
        flight_entry& e = ring_[static_cast<std::size_t>((recorded_ - 1) % ring_.size())];
        if (e.state == op_state::queued || e.state == op_state::running) {
            e.state = op_state::failed;
            e.end_ns = ticks();
        }
    }

    /// The time this handle spent between its operations since it was made, in steady-clock ns:
    /// the sum over its operations, in order, of the time from the end of the one before to the
    /// start of the next (an operation queued before the one before ended counts from that one's
    /// start). A replica's own work between collectives, which its peers wait for
    /// (train_params::report_stragglers_every). Counted with K == 0 too.
    std::int64_t between_ns() const noexcept { return tick_scale(origin_).span_ns(between_); }

    /// The recorded operations, oldest first (at most capacity()), times in steady-clock ns.
    std::vector<flight_entry> entries() const {
        std::vector<flight_entry> out;
        const std::uint64_t k = ring_.size();
        const std::uint64_t first = recorded_ > k ? recorded_ - k : 0;
        const tick_scale scale(origin_);
        for (std::uint64_t i = first; i < recorded_; ++i) {
            flight_entry e = ring_[static_cast<std::size_t>(i % k)];
            e.start_ns = scale.ns(e.start_ns);
            e.end_ns = e.end_ns == 0 ? 0 : scale.ns(e.end_ns);
            out.push_back(e);
        }
        return out;
    }

    /// Writes the ring (see the class comment) for `replica` of a group of `size`, after an
    /// error described by `reason`; `group` names the group where the backend knows it ("" for
    /// the whole group, "split(color=1)" for a split), so that trace_merge.py keeps a group's
    /// and its split's files apart. Returns the file written, or "" when LOCKSTEP_TRACE_DIR is
    /// unset or the file cannot be written. Never throws.
    std::string dump(int replica, int size, const std::string& reason,
                     const std::string& group = {}) const noexcept {
        try {
            return dump_or_throw(replica, size, reason, group);
        } catch (...) {
            return {};
        }
    }

    /// e again, with " [flight recorder: <file>]" appended when dump wrote one.
    static error with_trace(const error& e, const std::string& file) {
        if (file.empty())
            return e;
        const std::string prefix = error(e.code(), e.replica(), e.operation(), "").what();
        std::string details = e.what();
        details = details.size() >= prefix.size() ? details.substr(prefix.size()) : details;
        return error(e.code(), e.replica(), e.operation(),
                     details + " [flight recorder: " + file + "]");
    }

    /// Whether an error of this code is one the recorder is written for: the replicas
    /// disagree, wait for each other in vain, or one of them failed.
    static constexpr bool dumps_on(errc c) noexcept {
        return c == errc::timeout || c == errc::peer_failure || c == errc::count_mismatch ||
               c == errc::shape_mismatch;
    }

    /// Marks an operation done when it leaves its scope normally, failed when an exception
    /// leaves it. Movable, for communicators that return their operation state.
    class scope {
    public:
        scope() = default;
        scope(flight_recorder& r, std::size_t slot, std::uint64_t seq) noexcept
            : rec_(&r), slot_(slot), seq_(seq), exceptions_(std::uncaught_exceptions()) {}
        scope(scope&& o) noexcept
            : rec_(std::exchange(o.rec_, nullptr)), slot_(o.slot_), seq_(o.seq_),
              exceptions_(o.exceptions_) {}
        scope& operator=(scope&&) = delete;
        ~scope() {
            if (rec_ != nullptr)
                rec_->finish(slot_, seq_,
                             std::uncaught_exceptions() > exceptions_ ? op_state::failed
                                                                      : op_state::done);
        }

    private:
        flight_recorder* rec_ = nullptr;
        std::size_t slot_ = no_slot;
        std::uint64_t seq_ = 0;
        int exceptions_ = 0;
    };

private:
    static std::int64_t now_ns() noexcept {
        return std::chrono::duration_cast<std::chrono::nanoseconds>(
                   std::chrono::steady_clock::now().time_since_epoch())
            .count();
    }

    // The ring stores ticks: the x86 time-stamp counter where there is one (a third of a
    // clock read's cost, which showed on small MPI all_reduces), else steady-clock ns;
    // entries() maps them to steady-clock ns through two (ticks, ns) points.
    static std::int64_t ticks() noexcept {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
        unsigned lo = 0, hi = 0;
        __asm__ __volatile__("rdtsc" : "=a"(lo), "=d"(hi));
        return static_cast<std::int64_t>((static_cast<std::uint64_t>(hi) << 32) | lo);
#else
        return now_ns();
#endif
    }
    struct tick_point {
        std::int64_t ticks;
        std::int64_t ns;
    };
    static tick_point tick_now() noexcept {
        return {ticks(), now_ns()};
    }
    // Ticks to ns, linear through the recorder's origin and now.
    struct tick_scale {
        tick_point a, b;
        explicit tick_scale(tick_point origin) : a(origin), b(tick_now()) {}
        std::int64_t ns(std::int64_t t) const noexcept {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
            const double span = static_cast<double>(b.ticks - a.ticks);
            const double rate = span > 0 ? static_cast<double>(b.ns - a.ns) / span : 0.0;
            return a.ns + static_cast<std::int64_t>(static_cast<double>(t - a.ticks) * rate);
#else
            return t;
#endif
        }
        /// A duration of t ticks in ns.
        std::int64_t span_ns(std::int64_t t) const noexcept {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
            return ns(a.ticks + t) - a.ns;
#else
            return t;
#endif
        }
    };

    static std::string json_string(const std::string& s) {
        std::string out = "\"";
        for (const char c : s) {
            if (c == '"' || c == '\\') {
                out += '\\';
                out += c;
            } else if (static_cast<unsigned char>(c) < 0x20) {
                char buf[8];
                std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned>(c));
                out += buf;
            } else
                out += c;
        }
        return out + "\"";
    }

    static std::string line_of(const flight_entry& e) {
        char buf[320];
        std::snprintf(buf, sizeof buf,
                      "{\"seq\": %llu, \"op\": \"%s\", \"type\": \"%s\", \"count\": %llu, "
                      "\"peer\": %d, \"state\": \"%s\", \"start_ns\": %lld, \"end_ns\": %lld}",
                      static_cast<unsigned long long>(e.seq), e.op, e.type,
                      static_cast<unsigned long long>(e.count), e.peer, to_string(e.state),
                      static_cast<long long>(e.start_ns), static_cast<long long>(e.end_ns));
        return buf;
    }

    std::string dump_or_throw(int replica, int size, const std::string& reason,
                              const std::string& group) const {
        const auto ops = entries();
        // The offset lets files from different processes share one (wall-clock) time line.
        const auto wall = std::chrono::duration_cast<std::chrono::nanoseconds>(
                              std::chrono::system_clock::now().time_since_epoch())
                              .count();
        const std::int64_t offset = wall - now_ns();
#if defined(_WIN32)
        const long pid = static_cast<long>(_getpid());
#else
        const long pid = static_cast<long>(getpid());
#endif
        std::string file;
        if (const char* dir = std::getenv("LOCKSTEP_TRACE_DIR"); dir != nullptr && *dir != '\0') {
            file = std::string(dir) + "/lockstep-trace." + label_ + "." + std::to_string(pid) +
                   "." + std::to_string(replica) + "." + std::to_string(id_) + ".jsonl";
            if (std::FILE* f = std::fopen(file.c_str(), "w")) {
                std::fprintf(f,
                             "{\"lockstep_trace\": 1, \"label\": \"%s\", \"replica\": %d, "
                             "\"size\": %d, \"group\": %s, \"pid\": %ld, \"capacity\": %zu, "
                             "\"wall_offset_ns\": %lld, \"reason\": %s}\n",
                             label_, replica, size, json_string(group).c_str(), pid, ring_.size(),
                             static_cast<long long>(offset), json_string(reason).c_str());
                for (const auto& e : ops)
                    std::fprintf(f, "%s\n", line_of(e).c_str());
                if (std::fclose(f) != 0)
                    file.clear();
            } else
                file.clear();
        }
        // One fprintf per line keeps lines of replicas dumping at once apart.
        constexpr std::size_t shown = 4;
        std::fprintf(stderr,
                     "lockstep flight recorder: %s replica %d of %d, last %zu of %zu ops%s%s\n",
                     label_, replica, size, std::min(shown, ops.size()), ops.size(),
                     file.empty() ? "" : ", all in ", file.c_str());
        for (std::size_t i = ops.size() > shown ? ops.size() - shown : 0; i < ops.size(); ++i) {
            const auto& e = ops[i];
            std::fprintf(stderr, "  replica %d: %s #%llu (%llu %s, peer %d): %s\n", replica, e.op,
                         static_cast<unsigned long long>(e.seq),
                         static_cast<unsigned long long>(e.count), e.type, e.peer,
                         to_string(e.state));
        }
        std::fflush(stderr);
        return file;
    }

    static std::uint64_t next_id() noexcept {
        static std::atomic<std::uint64_t> recorders{0};
        return recorders.fetch_add(1);
    }

    const char* label_;
    std::uint64_t id_ = next_id();
    tick_point origin_ = tick_now();
    std::vector<flight_entry> ring_;
    std::uint64_t recorded_ = 0;
    std::int64_t last_end_ = 0; ///< ticks: when the newest operation ended (or started)
    std::int64_t between_ = 0;  ///< ticks between operations (between_ns)
};

} // namespace lockstep
