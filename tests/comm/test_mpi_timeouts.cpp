// Regression tests for MPI hangs and MPI errors on one rank: a rank that skips a collective and
// finishes, stalls, steps once more, passes a null buffer, arrives after a peer timed out (late:
// the timed-out request's buffers must stay valid), or never constructs a communicator that rank
// 0 constructs (ctor: the timeout names replica 0). Run as
//     mpiexec -n 3 test_mpi_timeouts <scenario> <result-dir>
// with LOCKSTEP_TIMEOUT=2. Each rank that observes the expected error writes "ok: <what>" to
// <result-dir>/rank<r>.txt, a wrong outcome writes "bad: ..."; the CTest script checks the file
// of every rank that must see the error, and the exit status (MPI_Abort's output can be lost
// when the job is torn down, files are not). SPDX-License-Identifier: Apache-2.0
#include "lockstep/comm/mpi_communicator.hpp"
#include "support/contains.hpp"

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <span>
#include <string>
#include <thread>
#include <vector>

using lockstep_test::contains;

namespace {

using lockstep::errc;
using lockstep::mpi_communicator;
using lockstep::reduce_op;

std::string g_dir;
int g_rank = -1;

void record(const std::string& line) {
    std::ofstream f(g_dir + "/rank" + std::to_string(g_rank) + ".txt", std::ios::app);
    f << line << '\n';
    f.flush();
}

void sum(mpi_communicator& comm, std::vector<float>& v) {
    comm.all_reduce(std::span<const float>(v), std::span<float>(v), reduce_op::sum);
}

// Checks a timeout error, records it, gives the other waiting ranks time to record theirs,
// then ends the job as the throwing mode requires.
[[noreturn]] void expect_timeout(mpi_communicator& comm, const lockstep::error& e,
                                 const std::string& op, const std::string& missing) {
    const std::string what = e.what();
    const bool good = e.code() == errc::timeout && contains(what, op) &&
                      contains(what, "missing replica(s) " + missing + " (") && comm.broken();
    // A broken communicator refuses the next call at once, with the first failure.
    bool refused = false;
    try {
        std::vector<float> v(1, 1.0f);
        sum(comm, v);
    } catch (const lockstep::error& again) {
        refused = again.code() == errc::timeout && contains(again.what(), "broken");
    }
    record((good && refused ? "ok: " : "bad: ") + what + (refused ? "" : " (not refused later)"));
    std::this_thread::sleep_for(std::chrono::milliseconds(3000));
    comm.abort(e, 2);
}

} // namespace

int main(int argc, char** argv) {
    lockstep::mpi_environment env(argc, argv);
    if (argc < 3) {
        std::fprintf(stderr,
                     "usage: test_mpi_timeouts skip|stall|extra|null|abort|late|ctor <dir>\n");
        return 2;
    }
    const std::string scenario = argv[1];
    g_dir = argv[2];
    const auto throwing = lockstep::mpi_failure_action::throw_error;
    mpi_communicator comm(
        MPI_COMM_WORLD,
        {.on_failure = scenario == "abort" ? lockstep::mpi_failure_action::abort : throwing});
    g_rank = comm.rank();
    if (scenario == "abort")
        record("started");
    const int last = comm.size() - 1;
    std::vector<float> v(8, float(comm.rank() + 1));
    try {
        if (comm.timeout() != std::chrono::milliseconds(2000))
            record("bad: LOCKSTEP_TIMEOUT=2 gave a timeout of " +
                   std::to_string(comm.timeout().count()) + " ms");
        sum(comm, v); // all_reduce #1, everybody
        if (scenario == "skip") {
            if (comm.rank() == last) // skips all_reduce #2 and finishes
                return 0;
            sum(comm, v);
            record("bad: all_reduce #2 returned although replica " + std::to_string(last) +
                   " skipped it");
        } else if (scenario == "stall" || scenario == "abort") {
            if (comm.rank() == 1)
                std::this_thread::sleep_for(std::chrono::seconds(20));
            sum(comm, v);
            record("bad: all_reduce #2 returned although replica 1 stalled");
        } else if (scenario == "extra") {
            sum(comm, v);
            if (comm.rank() == last) { // one step more than the others
                sum(comm, v);
                record("bad: all_reduce #3 returned although the others finished");
            }
            return 0;
        } else if (scenario == "null") {
            // Rank 0 passes a null buffer: an error on every rank, and the communicator
            // stays usable.
            std::span<float> bad = comm.rank() == 0
                                       ? std::span<float>(static_cast<float*>(nullptr), 8)
                                       : std::span<float>(v);
            std::string outcome = "bad: no error from all_reduce #2";
            try {
                comm.all_reduce(std::span<const float>(bad), bad, reduce_op::sum);
            } catch (const lockstep::error& e) {
                const std::string what = e.what();
                const bool good =
                    comm.rank() == 0
                        ? e.code() == errc::invalid_argument && contains(what, "all_reduce #2") &&
                              contains(what, "null pointer with 8 elements")
                        : e.code() == errc::peer_failure && contains(what, "all_reduce #2");
                outcome = (good ? "ok: " : "bad: ") + what;
            }
            std::vector<float> w(4, float(comm.rank() + 1));
            sum(comm, w); // 1 + 2 + 3
            const bool usable = !comm.broken() && w[0] == 6.0f && w[3] == 6.0f;
            record(usable ? outcome : "bad: the communicator is not usable after the refusal");
            return 0;
        } else if (scenario == "late") {
            // Rank 0 times out of a half all_reduce (300 ms) that the others join 800 ms late;
            // MPI still completes rank 0's exchange while it waits in the next collective. The
            // library's buffers of that request must stay valid (they used to be freed on the
            // throw, and MPI wrote into whatever was allocated there next): rank 0 allocates a
            // probe of the exchange buffer's size (n halves: n is a multiple of 2 and 3) at once.
            constexpr std::size_t n = 6144;
            mpi_communicator late(MPI_COMM_WORLD, {.verify = false,
                                                   .timeout = std::chrono::milliseconds(300),
                                                   .on_failure = throwing});
            std::vector<lockstep::half> h(n, lockstep::half(1.0f));
            if (comm.rank() != 0)
                std::this_thread::sleep_for(std::chrono::milliseconds(800));
            std::vector<std::uint16_t> probe;
            std::string outcome = comm.rank() == 0 ? "bad: all_reduce returned although the "
                                                     "others came 800 ms late"
                                                   : "ok: late, then ";
            try {
                late.all_reduce(std::span<const lockstep::half>(h), std::span<lockstep::half>(h),
                                reduce_op::sum);
            } catch (const lockstep::error& e) {
                probe.assign(n, 0xAAAA);
                if (comm.rank() == 0)
                    outcome = e.code() == errc::timeout ? "ok: " : "bad: ";
                outcome += e.what();
            }
            sum(comm, v); // #2 on the world: the late peers arrive, rank 0's exchange completes
            std::this_thread::sleep_for(std::chrono::milliseconds(200));
            sum(comm, v);
            std::size_t changed = 0;
            for (const std::uint16_t x : probe)
                changed += x != 0xAAAA;
            record(changed == 0 ? outcome
                                : "bad: MPI wrote " + std::to_string(changed) + " of " +
                                      std::to_string(probe.size()) +
                                      " elements of memory allocated after the timeout");
            return 0;
        } else if (scenario == "ctor") {
            if (comm.rank() == 0) {
                try {
                    mpi_communicator lone(
                        MPI_COMM_WORLD,
                        {.timeout = std::chrono::milliseconds(300), .on_failure = throwing});
                    record("bad: the constructor returned although no other process constructed "
                           "its communicator");
                } catch (const lockstep::error& e) {
                    const std::string what = e.what();
                    const bool good = e.code() == errc::timeout && e.replica() == 0 &&
                                      contains(what, "replica 0:") &&
                                      contains(what, "MPI_Comm_idup");
                    record((good ? "ok: " : "bad: ") + what + " (replica() " +
                           std::to_string(e.replica()) + ")");
                }
                comm.abort(2); // the others never join the MPI_Comm_idup: end the job
            }
            std::this_thread::sleep_for(std::chrono::seconds(20));
            record("bad: rank 0 did not end the job");
            return 0;
        } else {
            record("bad: unknown scenario " + scenario);
            return 2;
        }
    } catch (const lockstep::error& e) {
        if (scenario == "abort") { // mpi_failure_action::abort must end the job, not throw
            record(std::string("bad: the library threw instead of aborting: ") + e.what());
            comm.abort(e, 2);
        }
        const std::string missing = scenario == "skip"    ? std::to_string(last)
                                    : scenario == "extra" ? "0, 1"
                                                          : "1";
        const std::string op = scenario == "extra" ? "all_reduce #3" : "all_reduce #2";
        expect_timeout(comm, e, op, missing);
    }
    return 0;
}
