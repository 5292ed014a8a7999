// Tests of flight_recorder: the ring itself, and thread_group replicas that skip a collective or
// call all_gather where the others call all_reduce, or fail in a split and its parent, merged
// by scripts/trace_merge.py.
// SPDX-License-Identifier: Apache-2.0
#include "lockstep/comm/flight_recorder.hpp"
#include "lockstep/comm/simulated_link.hpp"
#include "lockstep/comm/thread_group.hpp"
#include "support/contains.hpp"

#include <catch2/catch.hpp>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include <unistd.h>

using lockstep::errc;
using lockstep::flight_recorder;
using lockstep::op_state;
using lockstep::reduce_op;
using lockstep::thread_communicator;
using lockstep::thread_group;

using lockstep_test::contains;

namespace {

/// A fresh directory for one test's trace files, set as LOCKSTEP_TRACE_DIR while it lives.
struct trace_dir {
    std::filesystem::path path;
    explicit trace_dir(const std::string& name)
        : path(std::filesystem::temp_directory_path() /
               ("lockstep_flight_" + name + "_" + std::to_string(::getpid()))) {
        std::filesystem::remove_all(path);
        std::filesystem::create_directories(path);
        ::setenv("LOCKSTEP_TRACE_DIR", path.c_str(), 1);
    }
    ~trace_dir() {
        ::unsetenv("LOCKSTEP_TRACE_DIR");
        std::filesystem::remove_all(path);
    }
    std::size_t files() const {
        std::size_t n = 0;
        for (const auto& e : std::filesystem::directory_iterator(path))
            n += e.path().extension() == ".jsonl" ? 1 : 0;
        return n;
    }
};

/// The output of scripts/trace_merge.py over dir.
std::string merge_report(const trace_dir& dir) {
    const std::string cmd = std::string("python3 \"") + LOCKSTEP_SOURCE_DIR +
                            "/scripts/trace_merge.py\" \"" + dir.path.string() + "\" 2>&1";
    std::FILE* p = ::popen(cmd.c_str(), "r");
    REQUIRE(p != nullptr);
    std::string out;
    char buf[512];
    while (std::fgets(buf, sizeof buf, p) != nullptr)
        out += buf;
    const int status = ::pclose(p);
    INFO(out);
    CHECK(status == 0);
    return out;
}

/// Runs body on every replica; collects the messages of the lockstep::errors they throw.
template <class Body>
std::vector<std::string> run_catching(thread_group& group, Body body) {
    std::vector<std::string> what(static_cast<std::size_t>(group.size()));
    try {
        group.run([&](thread_communicator& comm) {
            try {
                body(comm);
            } catch (const lockstep::error& e) {
                what[static_cast<std::size_t>(comm.rank())] = e.what();
            }
        });
    } catch (const lockstep::error&) {
        // A timeout fails the run as well; the replicas' own messages are checked.
    }
    return what;
}

void sum(thread_communicator& comm, std::size_t count) {
    std::vector<float> v(count, float(comm.rank() + 1));
    comm.all_reduce(std::span<const float>(v), std::span<float>(v), reduce_op::sum);
}

} // namespace

TEST_CASE("flight_recorder keeps the last K operations, oldest first", "[comm][trace]") {
    flight_recorder rec("unit", 3);
    REQUIRE(rec.capacity() == 3);
    for (std::uint64_t seq = 0; seq < 5; ++seq) {
        const auto slot = rec.record("all_reduce", seq, "float32", 10 + seq, -1);
        if (seq != 4)
            rec.finish(slot, seq, op_state::done);
    }
    const auto ops = rec.entries();
    REQUIRE(ops.size() == 3);
    CHECK(ops[0].seq == 2);
    CHECK(ops[0].count == 12);
    CHECK(ops[1].state == op_state::done);
    CHECK(ops[1].end_ns >= ops[1].start_ns);
    CHECK(ops[2].seq == 4);
    CHECK(ops[2].state == op_state::running);
    CHECK(ops[2].end_ns == 0);
    rec.fail_newest();
    CHECK(rec.entries()[2].state == op_state::failed);
    // A slot the ring has moved past is left alone.
    const auto old = rec.record("barrier", 5, "none", 0, -1);
    rec.record("barrier", 6, "none", 0, -1);
    rec.record("barrier", 7, "none", 0, -1);
    rec.record("barrier", 8, "none", 0, -1);
    rec.finish(old, 5, op_state::done);
    for (const auto& e : rec.entries())
        CHECK(e.state == op_state::running);
}

TEST_CASE("flight_recorder times an operation on the steady clock", "[comm][trace]") {
    flight_recorder rec("unit", 2);
    const auto before = std::chrono::steady_clock::now();
    const auto slot = rec.record("barrier", 0, "none", 0, -1);
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
    rec.finish(slot, 0, op_state::done);
    const auto after = std::chrono::steady_clock::now();
    const auto e = rec.entries().at(0);
    const auto ns = [](auto t) {
        return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
    };
    // The ring's ticks map to steady-clock ns (within a millisecond of the reads around them).
    CHECK(e.start_ns >= ns(before) - 1000000);
    CHECK(e.end_ns <= ns(after) + 1000000);
    CHECK(e.end_ns - e.start_ns >= 29000000);
}

TEST_CASE("flight_recorder adds up the time between operations, also with K = 0", "[comm][trace]") {
    // Each span is bracketed by steady-clock readings taken around the calls that record its
    // ends, so the checks hold however late a loaded machine runs them; the recorder converts its
    // ticks with a calibrated rate (1 % and 1 ms of slack).
    using clock = std::chrono::steady_clock;
    const auto span = [](clock::time_point from, clock::time_point to) {
        return std::chrono::duration_cast<std::chrono::nanoseconds>(to - from).count();
    };
    const auto within = [](std::int64_t v, std::int64_t lo, std::int64_t hi) {
        return v >= lo - lo / 100 - 1000000 && v <= hi + hi / 100 + 1000000;
    };
    for (const std::size_t k : {std::size_t(0), std::size_t(1), std::size_t(4)}) {
        CAPTURE(k);
        flight_recorder rec("unit", k);
        const auto pause = [](int ms) {
            std::this_thread::sleep_for(std::chrono::milliseconds(ms));
        };
        pause(20); // before the first operation: not between two
        auto a = rec.record("all_reduce", 0, "float32", 1, -1);
        pause(30); // inside an operation: not between
        const auto t0 = clock::now();
        rec.finish(a, 0, op_state::done);
        const auto t1 = clock::now();
        CHECK(rec.between_ns() == 0);
        pause(40); // between the end of one and the start of the next
        const auto t2 = clock::now();
        auto b = rec.record("all_reduce", 1, "float32", 1, -1);
        const auto t3 = clock::now();
        const std::int64_t one = rec.between_ns();
        CHECK(one >= 39000000);
        CHECK(within(one, span(t1, t2), span(t0, t3)));
        pause(10); // an operation queued before b ended counts from b's start
        const auto t4 = clock::now();
        auto c = rec.record("all_gather", 2, "float32", 1, -1, op_state::queued);
        const auto t5 = clock::now();
        rec.finish(b, 1, op_state::done);
        rec.finish(c, 2, op_state::done);
        CHECK(rec.between_ns() - one >= 9000000);
        CHECK(within(rec.between_ns() - one, span(t3, t4), span(t2, t5)));
    }
}

TEST_CASE("flight_recorder with K = 0 records nothing", "[comm][trace]") {
    flight_recorder rec("unit", 0);
    CHECK(rec.record("all_reduce", 0, "float32", 1, -1) == flight_recorder::no_slot);
    rec.fail_newest();
    CHECK(rec.entries().empty());
}

TEST_CASE("a thread replica that skips a collective is named by the merged trace",
          "[comm][thread][trace]") {
    trace_dir dir("skip");
    thread_group group(3, {.timeout = std::chrono::seconds(20)});
    // Step i all-reduces i + 1 floats; replica 1 skips step 2, so its step 3 meets the others'
    // step 2 as collective #2.
    const auto what = run_catching(group, [](thread_communicator& comm) {
        for (std::size_t step = 0; step < 4; ++step)
            if (!(comm.rank() == 1 && step == 2))
                sum(comm, step + 1);
    });
    for (const auto& w : what) {
        INFO(w);
        CHECK(contains(w, "all_reduce #2"));
        CHECK(contains(w, "[flight recorder: " + dir.path.string() + "/lockstep-trace.thread."));
    }
    CHECK(dir.files() == 3);
    const std::string report = merge_report(dir);
    INFO(report);
    CHECK(contains(report, "first divergence at #2: replicas 0, 2 called all_reduce #2 (3 "
                           "float32, failed); replica 1 called all_reduce #2 (4 float32"));
    CHECK(contains(report, "culprit: replica 1 at #2"));
}

TEST_CASE("a thread replica calling all_gather where the others all_reduce is named",
          "[comm][thread][trace]") {
    trace_dir dir("gather");
    thread_group group(3, {.timeout = std::chrono::seconds(20)});
    const auto what = run_catching(group, [](thread_communicator& comm) {
        sum(comm, 4);
        sum(comm, 4);
        std::vector<float> v(4, 1.0f), all(12);
        if (comm.rank() == 2)
            comm.all_gather(std::span<const float>(v), std::span<float>(all));
        else
            comm.all_reduce(std::span<const float>(v), std::span<float>(v), reduce_op::sum);
    });
    for (const auto& w : what) {
        INFO(w);
        CHECK(contains(w, "[shape_mismatch]"));
        CHECK(contains(w, "[flight recorder: "));
    }
    const std::string report = merge_report(dir);
    INFO(report);
    CHECK(contains(report, "first divergence at #2: replicas 0, 1 called all_reduce #2"));
    CHECK(contains(report, "replica 2 called all_gather #2 (4 float32, failed)"));
    CHECK(contains(report, "culprit: replica 2 at #2"));
}

TEST_CASE("a thread replica that stalls is named as missing after the others time out",
          "[comm][thread][trace]") {
    trace_dir dir("stall");
    thread_group group(3, {.timeout = std::chrono::milliseconds(300)});
    const auto what = run_catching(group, [](thread_communicator& comm) {
        sum(comm, 4);
        if (comm.rank() == 1) {
            // Stalls outside the communicator past the timeout, then leaves without a call.
            std::this_thread::sleep_for(std::chrono::milliseconds(800));
            return;
        }
        sum(comm, 4);
    });
    CHECK(contains(what[0], "all_reduce #1"));
    CHECK(what[1].empty());
    const std::string report = merge_report(dir);
    INFO(report);
    CHECK(dir.files() == 2);
    CHECK(contains(report, "replica 1: no trace file"));
    CHECK(contains(report, "culprit: replica 1 (missing (the others wait in #1))"));
}

TEST_CASE("a thread replica that comes back after the others timed out is named as late",
          "[comm][thread][trace]") {
    trace_dir dir("late");
    thread_group group(3, {.timeout = std::chrono::milliseconds(300)});
    const auto what = run_catching(group, [](thread_communicator& comm) {
        sum(comm, 4);
        if (comm.rank() == 1) // stalls past the timeout, then calls as the others did
            std::this_thread::sleep_for(std::chrono::milliseconds(800));
        sum(comm, 4);
    });
    for (const auto& w : what) {
        INFO(w);
        CHECK(contains(w, "all_reduce #1"));
    }
    const std::string report = merge_report(dir);
    INFO(report);
    CHECK(dir.files() == 3);
    CHECK(contains(report, "no divergence"));
    CHECK(contains(report, "culprit: replica 1 (late: the others timed out waiting for it in #1)"));
}

TEST_CASE("simulated_link shows its inner communicator's record", "[comm][thread][trace]") {
    thread_group group(2);
    std::vector<std::vector<lockstep::flight_entry>> seen(2);
    group.run([&](thread_communicator& comm) {
        lockstep::simulated_link<thread_communicator> link(comm);
        std::vector<double> v(3, 1.0), all(6);
        link.all_reduce(std::span<const double>(v), std::span<double>(v), reduce_op::max);
        link.broadcast(std::span<double>(v), 1);
        link.all_gather(std::span<const double>(v), std::span<double>(all));
        seen[static_cast<std::size_t>(comm.rank())] = link.trace().entries();
    });
    // Checked here: Catch2's assertions are not thread-safe. Before each forwarded collective
    // the link all-reduces one double (the replicas' common start time) through the same
    // inner communicator.
    for (const auto& ops : seen) {
        REQUIRE(ops.size() == 6);
        for (std::size_t i = 0; i < 6; i += 2) {
            CHECK(std::string(ops[i].op) == "all_reduce");
            CHECK(ops[i].count == 1);
        }
        CHECK(std::string(ops[1].op) == "all_reduce");
        CHECK(ops[1].count == 3);
        CHECK(std::string(ops[3].op) == "broadcast");
        CHECK(ops[3].peer == 1);
        CHECK(std::string(ops[5].op) == "all_gather");
        CHECK(std::string(ops[5].type) == "float64");
        CHECK(ops[5].seq == 5);
        for (const auto& e : ops)
            CHECK(e.state == op_state::done);
    }
}

TEST_CASE("a split and its parent on one replica write trace files of their own",
          "[comm][thread][trace]") {
    trace_dir dir("split");
    thread_group group(2, {.timeout = std::chrono::seconds(20)});
    // Each replica's split and then its parent disagree on a count (replica r passes r + 1 or
    // r + 3 floats): both handles of each replica dump their rings.
    std::vector<std::string> in_split(2), in_parent(2);
    group.run([&](thread_communicator& comm) {
        const auto me = static_cast<std::size_t>(comm.rank());
        thread_communicator half = comm.split(0, comm.rank());
        try {
            sum(half, me + 1);
        } catch (const lockstep::error& e) {
            in_split[me] = e.what();
        }
        try {
            sum(comm, me + 3);
        } catch (const lockstep::error& e) {
            in_parent[me] = e.what();
        }
    });
    const auto file_of = [](const std::string& what) {
        const std::string mark = "[flight recorder: ";
        const auto at = what.find(mark);
        if (at == std::string::npos)
            return std::string();
        const auto from = at + mark.size();
        return what.substr(from, what.find(']', from) - from);
    };
    const auto first_line = [](const std::string& path) {
        std::ifstream in(path);
        std::string line;
        std::getline(in, line);
        return line;
    };
    CHECK(dir.files() == 4);
    for (std::size_t r = 0; r < 2; ++r) {
        CAPTURE(r, in_split[r], in_parent[r]);
        CHECK(contains(in_split[r], "all_reduce #0 in split(color=0)"));
        const std::string split_file = file_of(in_split[r]);
        const std::string parent_file = file_of(in_parent[r]);
        REQUIRE_FALSE(split_file.empty());
        REQUIRE_FALSE(parent_file.empty());
        CHECK(split_file != parent_file);
        // Each file's header gives its own error as the reason.
        CHECK(contains(first_line(split_file), "in split(color=0)"));
        const std::string parent_header = first_line(parent_file);
        CHECK(contains(parent_header, "all_reduce #1"));
        CHECK_FALSE(contains(parent_header, "split(color=0)"));
    }
    // The merge keeps the two groups apart: both replicas' files in each, none left out.
    const std::string report = merge_report(dir);
    INFO(report);
    CHECK(contains(report, "== thread group of 2 replicas: 2 trace file(s)"));
    CHECK(contains(report, "== thread split(color=0) group of 2 replicas: 2 trace file(s)"));
    CHECK_FALSE(contains(report, "not merged"));
}
