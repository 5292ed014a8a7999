// save_checkpoint_async killed for real: a child process trains 2 thread replicas, saves in the
// background and SIGKILLs itself from the writer thread at each stage of the write (shard half
// written, written, renamed; marker half written, written, renamed; clean-up done); the parent
// loads what is left: the previous checkpoint before the marker's rename, the new one after it.
// Corruption of a background save's shard and marker is refused as a blocking save's is.
// Not run under ThreadSanitizer (fork after threads): its label is checkpoint only.
// SPDX-License-Identifier: Apache-2.0
#include <catch2/catch.hpp>

#include "checkpoint_support.hpp"
#include "train_runner.hpp"

#include "lockstep/optim/sgd.hpp"
#include "lockstep/train/async_checkpoint.hpp"

#include <chrono>
#include <csignal>
#include <cstdio>
#include <exception>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <sys/wait.h>
#include <unistd.h>

using namespace lockstep_test;

namespace {

using dp_type =
    data_parallel<mlp<float, thread_communicator, storage::registry, bn::global>, optim::sgd<float>,
                  sync::synchronous, reduce::per_tensor, thread_communicator>;
using net = dp_type::network_type;
const optim::sgd_params sgd{.lr = 0.05, .momentum = 0.9};
constexpr int replicas = 2;

void step_to(dp_type& dp, std::int64_t steps) {
    const std::size_t cycle[] = {37, 9, 12, 7, 20};
    while (dp.steps() < steps)
        dp.step(cycle[static_cast<std::size_t>(dp.steps()) % 5],
                [](auto& n, const shard_range& r, auto& ctx) { return n.train(r, ctx); });
}

/// Every replica's fingerprint after `steps` steps from seed 42 (the same bits in any process).
std::vector<std::vector<std::byte>> state_after(std::int64_t steps) {
    std::vector<std::vector<std::byte>> out(replicas);
    thread_group(replicas).run([&](thread_communicator& comm) {
        dp_type dp(
            comm, [](auto& ctx) { return net(ctx); }, sgd, train_params{.seed = 42});
        step_to(dp, steps);
        out[static_cast<std::size_t>(comm.rank())] = fingerprint(dp);
    });
    return out;
}

std::vector<std::vector<std::byte>> load_all(const fs::path& path) {
    std::vector<std::vector<std::byte>> out(replicas);
    thread_group(replicas).run([&](thread_communicator& comm) {
        dp_type dp(
            comm, [](auto& ctx) { return net(ctx); }, sgd, train_params{.seed = 7});
        load_checkpoint(dp, path);
        out[static_cast<std::size_t>(comm.rank())] = fingerprint(dp);
    });
    return out;
}

/// The child: a checkpoint after 3 steps, then a background save after 5 whose writer
/// SIGKILLs the process at `stage` on `replica`; steps on while it writes. Exit status 3: the
/// kill never came; 4: an exception (it must not reach Catch2 in the forked child).
[[noreturn]] void child(const fs::path& path, std::string_view stage, int replica) try {
    thread_group(replicas).run([&](thread_communicator& comm) {
        dp_type dp(
            comm, [](auto& ctx) { return net(ctx); }, sgd, train_params{.seed = 42});
        step_to(dp, 3);
        save_checkpoint(dp, path);
        step_to(dp, 5);
        save_checkpoint_async(dp, path, {.on_stage = [stage, replica](std::string_view s, int r) {
                                  if (s == stage && r == replica)
                                      std::raise(SIGKILL);
                              }});
        for (int i = 0; i < 2000; ++i) {
            step_to(dp, dp.steps() + 1);
            std::this_thread::sleep_for(std::chrono::milliseconds(1));
        }
        dp.finish();
    });
    ::_exit(3);
} catch (const std::exception& e) {
    std::fprintf(stderr, "child: %s\n", e.what());
    ::_exit(4);
} catch (...) {
    ::_exit(4);
}

} // namespace

TEST_CASE("a background save SIGKILLed at any stage leaves a loadable checkpoint",
          "[train][checkpoint]") {
    struct kill_case {
        const char* stage;
        int replica;
        bool committed; ///< a load finds the new checkpoint afterwards
    };
    const kill_case cases[] = {{"shard.partial", 1, false},    {"shard.written", 0, false},
                               {"shard.renamed", 1, false},    {"manifest.partial", 0, false},
                               {"manifest.written", 0, false}, {"manifest.renamed", 0, true},
                               {"cleanup.done", 0, true}};
    const auto at3 = state_after(3);
    const auto at5 = state_after(5);
    REQUIRE(at3 != at5);
    for (const kill_case& c : cases) {
        DYNAMIC_SECTION("SIGKILL at " << c.stage << " on replica " << c.replica) {
            temp_dir dir;
            const fs::path path = dir.path / "x.ckpt";
            const ::pid_t pid = ::fork();
            REQUIRE(pid >= 0);
            if (pid == 0)
                child(path, c.stage, c.replica);
            int status = 0;
            REQUIRE(::waitpid(pid, &status, 0) == pid);
            REQUIRE(WIFSIGNALED(status));
            CHECK(WTERMSIG(status) == SIGKILL);
            CHECK(load_all(path) == (c.committed ? at5 : at3));
        }
    }
}

TEST_CASE("a background save's corrupted shard or marker is refused", "[train][checkpoint]") {
    temp_dir dir;
    const fs::path path = dir.path / "x.ckpt";
    thread_group(replicas).run([&](thread_communicator& comm) {
        dp_type dp(
            comm, [](auto& ctx) { return net(ctx); }, sgd, train_params{.seed = 42});
        step_to(dp, 4);
        save_checkpoint_async(dp, path);
        step_to(dp, 6);
        (void)wait_checkpoint(dp);
    });
    REQUIRE(load_all(path) == state_after(4));
    std::vector<fs::path> files; // the marker, then shard 0 and shard 1
    files.push_back(path);
    for (const char* suffix : {".shard0", ".shard1"})
        for (const auto& e : fs::directory_iterator(dir.path))
            if (e.path().string().ends_with(suffix))
                files.push_back(e.path());
    REQUIRE(files.size() == 1 + replicas);
    for (std::size_t k = 0; k < files.size(); ++k) {
        DYNAMIC_SECTION("one byte of " << (k == 0 ? "the marker" : "a shard") << " flipped, "
                                       << k) {
            const fs::path& f = files[k];
            std::vector<std::byte> bytes = read_all(f);
            const std::vector<std::byte> original = bytes;
            bytes[bytes.size() / 2] ^= std::byte{0x10};
            write_all(f, bytes);
            std::string message;
            try {
                (void)load_all(path);
            } catch (const lockstep::error& e) {
                if (e.code() == errc::checkpoint)
                    message = e.what();
            }
            CHECK(message.find("refused") != std::string::npos);
            write_all(f, original);
            CHECK(load_all(path) == state_after(4));
        }
    }
}
