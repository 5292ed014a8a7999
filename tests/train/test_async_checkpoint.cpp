// save_checkpoint_async on thread replicas: the snapshot is the state at the save however many
// steps run during the write (it loads as, and resumes as, a blocking save at that step), the
// commit is reported by the same step on every replica, a failure or crash at any stage of the
// background write leaves the previous checkpoint loadable and is reported on every replica,
// an unreported failure (none reported, or reported only by steps that threw) is thrown by the
// next save, wait_checkpoint and finish(), and a second save waits for the first.
// SPDX-License-Identifier: Apache-2.0
#include <catch2/catch.hpp>

#include "checkpoint_support.hpp"
#include "support/contains.hpp"
#include "train_runner.hpp"

#include "lockstep/optim/sgd.hpp"
#include "lockstep/train/async_checkpoint.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <limits>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <fcntl.h>
#include <unistd.h>

using namespace lockstep_test;

namespace {

using opt_type = optim::sgd<float>;
const optim::sgd_params sgd{.lr = 0.05, .momentum = 0.9};
using dp_type = data_parallel<mlp<float, thread_communicator, storage::registry, bn::global>,
                              opt_type, sync::synchronous, reduce::per_tensor, thread_communicator>;
using net = dp_type::network_type;

train_params params_for(std::uint64_t seed) {
    return {.seed = seed};
}

std::size_t batch_of(std::int64_t step) {
    const std::size_t cycle[] = {37, 9, 12, 7, 20};
    return cycle[static_cast<std::size_t>(step) % 5];
}

step_result one_step(dp_type& dp) {
    return dp.step(batch_of(dp.steps()),
                   [](auto& n, const shard_range& r, auto& ctx) { return n.train(r, ctx); });
}

/// Steps until a step reports the background save's end (at most `limit` steps, sleeping 1 ms
/// between them so the writer threads run): the event and the step that reported it (-1: none).
std::pair<checkpoint_event, std::int64_t> step_until_end(dp_type& dp, int limit = 2000) {
    for (int i = 0; i < limit; ++i) {
        const step_result r = one_step(dp);
        if (r.checkpoint != checkpoint_event::none)
            return {r.checkpoint, r.step};
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    return {checkpoint_event::none, -1};
}

/// A gate a writer thread waits at until the test opens it (or 10 s pass: a test that forgot
/// to open it fails instead of hanging).
struct gate {
    std::atomic<bool> open{false};
    void wait() const {
        const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
        while (!open.load() && std::chrono::steady_clock::now() < until)
            std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
};

/// Every replica's fingerprint after loading `path` into trainers built with another seed.
std::vector<std::vector<std::byte>> load_all(int replicas, const fs::path& path) {
    std::vector<std::vector<std::byte>> out(static_cast<std::size_t>(replicas));
    thread_group(replicas).run([&](thread_communicator& comm) {
        dp_type dp(
            comm, [](auto& ctx) { return net(ctx); }, sgd, params_for(7));
        load_checkpoint(dp, path);
        out[static_cast<std::size_t>(comm.rank())] = fingerprint(dp);
    });
    return out;
}

std::size_t files_in(const fs::path& dir) {
    std::size_t n = 0;
    for (const auto& e : fs::directory_iterator(dir)) {
        (void)e;
        ++n;
    }
    return n;
}

} // namespace

TEST_CASE("a background save is the state at the save, committed at one step on every replica",
          "[train][checkpoint][thread]") {
    constexpr int replicas = 3;
    temp_dir dir;
    const fs::path blocking = dir.path / "blocking.ckpt";
    const fs::path background = dir.path / "background.ckpt";
    gate held;
    std::vector<std::vector<std::byte>> at_save(replicas), at_end(replicas), undisturbed(replicas);
    std::vector<int> none_while_held(replicas), waited(replicas);
    std::vector<std::int64_t> committed_at(replicas), steps_at_end(replicas);
    const save_options hold{.on_stage = [&](std::string_view stage, int) {
        if (stage == "shard.partial")
            held.wait();
    }};
    thread_group(replicas).run([&](thread_communicator& comm) {
        const auto r = static_cast<std::size_t>(comm.rank());
        dp_type dp(
            comm, [](auto& ctx) { return net(ctx); }, sgd, params_for(42));
        while (dp.steps() < 3)
            one_step(dp);
        save_checkpoint(dp, blocking);
        at_save[r] = fingerprint(dp);
        save_checkpoint_async(dp, background, hold);
        // Every writer is held half-way through its shard while 6 steps change every tensor.
        int none = 1;
        for (int i = 0; i < 6; ++i)
            none = none && one_step(dp).checkpoint == checkpoint_event::none;
        comm.barrier();
        if (r == 0)
            held.open = true;
        none_while_held[r] = none;
        const auto [event, step] = step_until_end(dp);
        committed_at[r] = event == checkpoint_event::committed ? step : -1;
        waited[r] = wait_checkpoint(dp) == checkpoint_event::committed;
        // 40 steps, or more when the commit came later (a loaded machine): the same on every
        // replica, since every replica saw the commit at the same step.
        const std::int64_t end = std::max<std::int64_t>(40, dp.steps() + 1);
        while (dp.steps() < end)
            one_step(dp);
        dp.finish();
        at_end[r] = fingerprint(dp);
        steps_at_end[r] = dp.steps();
    });
    for (int r = 0; r < replicas; ++r) {
        INFO("replica " << r);
        CHECK(none_while_held[r] == 1);
        CHECK(committed_at[r] >= 9);
        CHECK(committed_at[r] == committed_at[0]); // the same step on every replica
        CHECK(waited[r] == 1);
        CHECK(steps_at_end[r] == steps_at_end[0]);
        CHECK(steps_at_end[r] >= 40);
    }
    // Never torn: what loads is the state at the save, as the blocking save at that step.
    CHECK(load_all(replicas, background) == at_save);
    CHECK(load_all(replicas, blocking) == at_save);
    // And it resumes to the end of the undisturbed run, bit for bit.
    std::vector<std::vector<std::byte>> resumed(replicas);
    thread_group(replicas).run([&](thread_communicator& comm) {
        dp_type dp(
            comm, [](auto& ctx) { return net(ctx); }, sgd, params_for(7));
        load_checkpoint(dp, background);
        while (dp.steps() < steps_at_end[0])
            one_step(dp);
        resumed[static_cast<std::size_t>(comm.rank())] = fingerprint(dp);
    });
    CHECK(resumed == at_end);
    // Both checkpoints' files, each a marker and three shards: nothing else.
    CHECK(files_in(dir.path) == 2 * (1 + std::size_t{replicas}));
}

TEST_CASE("a background save that fails at any stage keeps the previous checkpoint",
          "[train][checkpoint][thread]") {
    struct crash_case {
        const char* stage;
        int replica;
        bool committed; ///< a load finds the new checkpoint afterwards
    };
    const crash_case cases[] = {{"shard.partial", 1, false},    {"shard.written", 0, false},
                                {"shard.renamed", 2, false},    {"manifest.partial", 0, false},
                                {"manifest.written", 0, false}, {"manifest.renamed", 0, true},
                                {"cleanup.done", 0, true}};
    constexpr int replicas = 3;
    for (const crash_case& c : cases) {
        DYNAMIC_SECTION("crash at " << c.stage << " on replica " << c.replica) {
            temp_dir dir;
            const fs::path path = dir.path / "x.ckpt";
            std::vector<std::vector<std::byte>> at3(replicas), at5(replicas);
            std::vector<int> reported(replicas), thrown(replicas);
            std::vector<std::int64_t> failed_at(replicas);
            std::string message;
            const save_options crash{.on_stage = [&](std::string_view stage, int replica) {
                if (stage == c.stage && replica == c.replica)
                    throw std::runtime_error("simulated crash");
            }};
            thread_group(replicas).run([&](thread_communicator& comm) {
                const auto r = static_cast<std::size_t>(comm.rank());
                dp_type dp(
                    comm, [](auto& ctx) { return net(ctx); }, sgd, params_for(42));
                while (dp.steps() < 3)
                    one_step(dp);
                save_checkpoint_async(dp, path);
                at3[r] = fingerprint(dp);
                (void)wait_checkpoint(dp);
                while (dp.steps() < 5)
                    one_step(dp);
                at5[r] = fingerprint(dp);
                save_checkpoint_async(dp, path, crash);
                const auto [event, step] = step_until_end(dp);
                reported[r] = event == checkpoint_event::failed;
                failed_at[r] = step;
                try {
                    (void)wait_checkpoint(dp);
                } catch (const lockstep::error& e) {
                    // After the commit point the report says the save is the checkpoint.
                    const std::string committed = "so '" + path.string() + "' loads this save";
                    thrown[r] = e.code() == errc::checkpoint &&
                                contains(e.what(), "in the background failed: replica " +
                                                       std::to_string(c.replica) + ": ") &&
                                contains(e.what(), "simulated crash") &&
                                contains(e.what(), committed) == c.committed;
                    if (r == 0)
                        message = e.what();
                }
                dp.finish(); // reported and thrown: nothing left to throw
            });
            INFO(message);
            for (int r = 0; r < replicas; ++r) {
                INFO("replica " << r);
                CHECK(reported[r] == 1);
                CHECK(failed_at[r] == failed_at[0]);
                CHECK(thrown[r] == 1);
            }
            CHECK(load_all(replicas, path) == (c.committed ? at5 : at3));
            // A later save removes every leftover of the failed one.
            thread_group(replicas).run([&](thread_communicator& comm) {
                dp_type dp(
                    comm, [](auto& ctx) { return net(ctx); }, sgd, params_for(1));
                load_checkpoint(dp, path);
                save_checkpoint_async(dp, path);
                dp.finish();
            });
            CHECK(files_in(dir.path) == 1 + replicas);
        }
    }
}

TEST_CASE("a background failure no step reported is thrown by the next save and by finish",
          "[train][checkpoint][thread]") {
    constexpr int replicas = 2;
    temp_dir dir;
    const fs::path path = dir.path / "x.ckpt";
    const save_options crash{.on_stage = [](std::string_view stage, int replica) {
        if (stage == "shard.written" && replica == 1)
            throw std::runtime_error("simulated crash");
    }};
    std::vector<int> next_save_threw(replicas), finish_threw(replicas), third_committed(replicas);
    thread_group(replicas).run([&](thread_communicator& comm) {
        const auto r = static_cast<std::size_t>(comm.rank());
        dp_type dp(
            comm, [](auto& ctx) { return net(ctx); }, sgd, params_for(42));
        one_step(dp);
        save_checkpoint_async(dp, path, crash);
        try {
            save_checkpoint_async(dp, path); // no step in between: nothing reported the failure
        } catch (const lockstep::error& e) {
            next_save_threw[r] = e.code() == errc::checkpoint &&
                                 contains(e.what(), "replica 1: simulated crash") &&
                                 contains(e.what(), "save_checkpoint_async");
        }
        save_checkpoint_async(dp, path);
        third_committed[r] = wait_checkpoint(dp) == checkpoint_event::committed;
        one_step(dp);
        save_checkpoint_async(dp, path, crash);
        try {
            dp.finish();
        } catch (const lockstep::error& e) {
            finish_threw[r] = e.code() == errc::checkpoint && contains(e.what(), "simulated crash");
        }
    });
    CHECK(next_save_threw == std::vector<int>{1, 1});
    CHECK(third_committed == std::vector<int>{1, 1});
    CHECK(finish_threw == std::vector<int>{1, 1});
}

TEST_CASE("a background failure shown only by steps that threw is thrown by finish",
          "[train][checkpoint][thread]") {
    constexpr int replicas = 2;
    constexpr int throwing_steps = 10;
    temp_dir dir;
    const fs::path path = dir.path / "x.ckpt";
    std::atomic<bool> crashed{false};
    const save_options crash{.on_stage = [&](std::string_view stage, int replica) {
        if (stage == "shard.written" && replica == 1) {
            crashed = true;
            throw std::runtime_error("simulated crash");
        }
    }};
    std::vector<int> steps_threw(replicas), finish_threw(replicas);
    thread_group(replicas).run([&](thread_communicator& comm) {
        const auto r = static_cast<std::size_t>(comm.rank());
        train_params tp = params_for(42);
        tp.skip_non_finite = false; // a non-finite loss throws errc::non_finite on every replica
        dp_type dp(
            comm, [](auto& ctx) { return net(ctx); }, sgd, tp);
        one_step(dp);
        save_checkpoint_async(dp, path, crash);
        // Replica 1's shard failed (and its level is stored) before the next steps, whose rows
        // show it, then replica 0's refusal: every one of them throws (a NaN loss), and the
        // caller goes on. None returned a result, so none reported the failure.
        const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
        while (!crashed && std::chrono::steady_clock::now() < until)
            std::this_thread::sleep_for(std::chrono::milliseconds(1));
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
        for (int i = 0; i < throwing_steps; ++i) {
            try {
                (void)dp.step(batch_of(dp.steps()), [](auto& n, const shard_range& sr, auto& ctx) {
                    (void)n.train(sr, ctx);
                    return std::numeric_limits<double>::quiet_NaN();
                });
            } catch (const lockstep::error& e) {
                steps_threw[r] += e.code() == errc::non_finite ? 1 : 0;
            }
            std::this_thread::sleep_for(std::chrono::milliseconds(2));
        }
        try {
            dp.finish();
        } catch (const lockstep::error& e) {
            finish_threw[r] = e.code() == errc::checkpoint && contains(e.what(), "simulated crash");
        }
    });
    CHECK(steps_threw == std::vector<int>(replicas, throwing_steps));
    CHECK(finish_threw == std::vector<int>{1, 1});
}

TEST_CASE("a second background save waits for the first: one in flight",
          "[train][checkpoint][thread]") {
    constexpr int replicas = 2;
    temp_dir dir;
    const fs::path path = dir.path / "x.ckpt";
    std::mutex m;
    std::vector<std::string> order; // replica 0's stages, tagged with the save
    gate held;
    const auto recorder = [&](const std::string& tag, bool hold) {
        return save_options{.on_stage = [&, tag, hold](std::string_view stage, int replica) {
            if (hold && stage == "shard.partial")
                held.wait();
            if (replica == 0) {
                const std::lock_guard lock(m);
                order.push_back(tag + std::string(stage));
            }
        }};
    };
    std::vector<std::vector<std::byte>> second(replicas);
    thread_group(replicas).run([&](thread_communicator& comm) {
        dp_type dp(
            comm, [](auto& ctx) { return net(ctx); }, sgd, params_for(42));
        one_step(dp);
        save_checkpoint_async(dp, path, recorder("1:", true));
        one_step(dp);
        if (comm.rank() == 0) // the second save has to wait for the held first one
            std::thread([&] {
                std::this_thread::sleep_for(std::chrono::milliseconds(50));
                held.open = true;
            }).detach();
        save_checkpoint_async(dp, path, recorder("2:", false));
        second[static_cast<std::size_t>(comm.rank())] = fingerprint(dp);
        one_step(dp);
        dp.finish();
    });
    const std::vector<std::string> expected{
        "1:shard.partial",    "1:shard.written",    "1:shard.renamed",    "1:manifest.partial",
        "1:manifest.written", "1:manifest.renamed", "1:cleanup.done",     "2:shard.partial",
        "2:shard.written",    "2:shard.renamed",    "2:manifest.partial", "2:manifest.written",
        "2:manifest.renamed", "2:cleanup.done"};
    CHECK(order == expected);
    CHECK(load_all(replicas, path) == second);
}

TEST_CASE("a background share outside (0, 1] is refused on every replica before any work",
          "[train][checkpoint][thread]") {
    temp_dir dir;
    for (const double share : {0.0, 1.5, std::numeric_limits<double>::quiet_NaN()}) {
        std::ostringstream shown;
        shown << "background_share = " << share;
        CAPTURE(shown.str());
        std::vector<int> refused(2);
        thread_group(2).run([&](thread_communicator& comm) {
            dp_type dp(
                comm, [](auto& ctx) { return net(ctx); }, sgd, params_for(42));
            try {
                save_checkpoint_async(dp, dir.path / "x.ckpt",
                                      {.on_stage = {}, .background_share = share});
            } catch (const lockstep::error& e) {
                refused[static_cast<std::size_t>(comm.rank())] =
                    e.code() == errc::invalid_argument && contains(e.what(), shown.str());
            }
            dp.finish(); // nothing was begun: nothing to wait for
        });
        CHECK(refused == std::vector<int>{1, 1});
        CHECK(files_in(dir.path) == 0);
    }
}

namespace {

/// What fd 2 receives while it lives (a temporary file behind it): the warnings a destructor
/// prints, which cannot be thrown.
class stderr_capture {
public:
    explicit stderr_capture(const fs::path& file) : file_(file) {
        std::fflush(stderr);
        saved_ = ::dup(2);
        const int fd = ::open(file.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
        ::dup2(fd, 2);
        ::close(fd);
    }
    stderr_capture(const stderr_capture&) = delete;
    stderr_capture& operator=(const stderr_capture&) = delete;
    ~stderr_capture() { restore(); }
    /// Restores fd 2 and returns what it received.
    std::string text() {
        restore();
        std::ifstream in(file_);
        return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
    }

private:
    void restore() {
        if (saved_ < 0)
            return;
        std::fflush(stderr);
        ::dup2(saved_, 2);
        ::close(saved_);
        saved_ = -1;
    }
    fs::path file_;
    int saved_ = -1;
};

} // namespace

TEST_CASE("a background save its trainer is destroyed without awaiting is named on stderr",
          "[train][checkpoint][thread]") {
    constexpr int replicas = 2;
    temp_dir dir;
    const fs::path path = dir.path / "x.ckpt";
    const auto run = [&](bool wait) {
        stderr_capture captured(dir.path / "stderr.txt");
        thread_group(replicas).run([&](thread_communicator& comm) {
            dp_type dp(
                comm, [](auto& ctx) { return net(ctx); }, sgd, params_for(42));
            one_step(dp);
            save_checkpoint(dp, path); // the previous checkpoint: step 1
            one_step(dp);
            // No step after it: no step reports its end, and replica 0 never commits it.
            save_checkpoint_async(dp, path);
            if (wait)
                (void)dp.finish();
        });
        return captured.text();
    };
    const std::string lost = run(false);
    INFO(lost);
    for (int r = 0; r < replicas; ++r)
        CHECK(contains(lost, "lockstep: replica " + std::to_string(r) +
                                 ": the background checkpoint save of step 2 to '" + path.string() +
                                 "' was neither committed nor awaited"));
    CHECK(contains(lost, "call finish() or wait_checkpoint() before the trainer goes"));
    CHECK(std::count(lost.begin(), lost.end(), '\n') == replicas);
    const std::string awaited = run(true);
    CHECK(awaited.empty());
}

TEST_CASE("a background save whose replicas pass different paths is refused before writing",
          "[train][checkpoint][thread]") {
    constexpr int replicas = 2;
    temp_dir dir;
    std::vector<std::string> thrown(replicas);
    std::vector<int> codes(replicas, -1);
    thread_group(replicas).run([&](thread_communicator& comm) {
        const auto me = static_cast<std::size_t>(comm.rank());
        dp_type dp(
            comm, [](auto& ctx) { return net(ctx); }, sgd, params_for(42));
        one_step(dp);
        // A directory per replica: as replicas on nodes that share no file system.
        try {
            save_checkpoint_async(dp, dir.path / ("r" + std::to_string(me)) / "x.ckpt");
        } catch (const lockstep::error& e) {
            thrown[me] = e.what();
            codes[me] = static_cast<int>(e.code());
        }
        (void)dp.finish();
    });
    for (std::size_t r = 0; r < replicas; ++r) {
        INFO(thrown[r]);
        CHECK(codes[r] == static_cast<int>(errc::invalid_argument));
        CHECK_THAT(thrown[r], Catch::Contains("every replica must pass the same path"));
    }
    CHECK_FALSE(fs::exists(dir.path / "r0"));
    CHECK_FALSE(fs::exists(dir.path / "r1"));
}

TEST_CASE("a background save whose shard replica 0 cannot see fails, uncommitted",
          "[train][checkpoint][thread]") {
    constexpr int replicas = 2;
    temp_dir dir;
    std::vector<int> event(replicas, -1);
    std::vector<std::string> thrown(replicas);
    const fs::path path = dir.path / "x.ckpt";
    // Replica 1's shard vanishes once written, as on a file system replica 0 does not share.
    save_options options;
    options.on_stage = [&](std::string_view stage, int replica) {
        if (replica != 1 || stage != "shard.renamed")
            return;
        for (const auto& e : fs::directory_iterator(dir.path))
            if (e.path().string().ends_with(".shard1"))
                fs::remove(e.path());
    };
    thread_group(replicas).run([&](thread_communicator& comm) {
        const auto me = static_cast<std::size_t>(comm.rank());
        dp_type dp(
            comm, [](auto& ctx) { return net(ctx); }, sgd, params_for(42));
        one_step(dp);
        save_checkpoint_async(dp, path, options);
        event[me] = static_cast<int>(step_until_end(dp).first);
        try {
            (void)dp.finish();
        } catch (const lockstep::error& e) {
            thrown[me] = e.what();
        }
    });
    for (int e : event)
        CHECK(e == static_cast<int>(checkpoint_event::failed));
    for (const std::string& t : thrown)
        CHECK(t.empty()); // every step result reported it: finish() does not throw it again
    CHECK_FALSE(fs::exists(path));
}
