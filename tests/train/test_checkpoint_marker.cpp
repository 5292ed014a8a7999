// The commit marker as a hostile input and a shared path (train/detail/checkpoint_marker.hpp):
// shard names leading out of the checkpoint's directory, symbolic links and recorded sizes that
// disagree with the file are refused before the shard is read; a FIFO at the marker's path is
// refused without blocking; checkpoints with the first format's shard names still load; two jobs
// saving to one path concurrently always leave a checkpoint that loads as one of their saves.
// SPDX-License-Identifier: Apache-2.0
#include <catch2/catch.hpp>

#include "checkpoint_support.hpp"
#include "support/contains.hpp"
#include "train_runner.hpp"

#include "lockstep/optim/sgd.hpp"
#include "lockstep/train/checkpoint.hpp"

#include <barrier>
#include <chrono>
#include <future>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

using namespace lockstep_test;

namespace {

using opt = optim::sgd<float>;
using dp_type = data_parallel<mlp<float, thread_communicator, storage::registry>, opt,
                              sync::synchronous, reduce::per_tensor, thread_communicator>;
using net = dp_type::network_type;
const optim::sgd_params opt_params{.lr = 0.05, .momentum = 0.9};

std::size_t batch_of(std::int64_t step) {
    const std::size_t cycle[] = {37, 9, 12, 7, 20};
    return cycle[static_cast<std::size_t>(step) % 5];
}

void step_once(dp_type& dp) {
    dp.step(batch_of(dp.steps()),
            [](net& n, const shard_range& r, auto& ctx) { return n.train(r, ctx); });
}

/// One replica, seed 42, 2 steps, saved to path; returns its fingerprint.
std::vector<std::byte> save_single(const fs::path& path) {
    std::vector<std::byte> fp;
    thread_group(1).run([&](thread_communicator& comm) {
        dp_type dp(comm, [](auto& ctx) { return net(ctx); }, opt_params, {.seed = 42});
        step_once(dp);
        step_once(dp);
        save_checkpoint(dp, path);
        fp = fingerprint(dp);
    });
    return fp;
}

struct load_outcome {
    std::string message; ///< empty: loaded
    bool unchanged = false;
    std::vector<std::byte> loaded;
};

/// Loads path into a fresh 1-replica trainer (seed 5).
load_outcome load_single(const fs::path& path) {
    load_outcome out;
    thread_group(1).run([&](thread_communicator& comm) {
        dp_type dp(comm, [](auto& ctx) { return net(ctx); }, opt_params, {.seed = 5});
        const auto before = fingerprint(dp);
        try {
            load_checkpoint(dp, path);
        } catch (const lockstep::error& e) {
            out.message = e.code() == errc::checkpoint ? e.what() : "wrong code";
        }
        out.loaded = fingerprint(dp);
        out.unchanged = out.loaded == before;
    });
    return out;
}

std::string marker_value(const fs::path& path, const std::string& key) {
    const auto m = read_all(path);
    return *ck::parse_header(m, ck::manifest_magic, "marker").find_meta(key);
}

} // namespace

TEST_CASE("a hostile commit marker cannot make the loader read outside the checkpoint",
          "[train][checkpoint][thread]") {
    temp_dir dir;
    temp_dir outside("outside");
    const fs::path path = dir.path / "h.ckpt";
    const auto saved = save_single(path);
    const auto good_marker = read_all(path);
    const fs::path shard = shard_file(path, 0);
    const std::string size = marker_value(path, "shard.0.size");
    const std::string gen = marker_value(path, "generation");
    // A valid shard outside the directory: following a name to it would load it.
    const fs::path copy = outside.path / "big_outside.bin";
    fs::copy_file(shard, copy);
    REQUIRE(load_single(path).loaded == saved); // control: the intact checkpoint loads

    auto refused_with = [&](const std::string& part) {
        const load_outcome o = load_single(path);
        INFO(o.message);
        CHECK(o.unchanged);
        CHECK(o.message.find("replica 0: load_checkpoint: checkpoint '" + path.string() +
                             "' refused") != std::string::npos);
        CHECK(o.message.find("commit marker '" + path.string() + "'") != std::string::npos);
        CHECK(o.message.find(part) != std::string::npos);
        write_all(path, good_marker);
    };
    const std::string not_a_shard = "' is not the name of a shard of this checkpoint";
    const std::string relative = "../" + outside.path.filename().string() + "/big_outside.bin";
    const std::vector<std::string> names = {relative,
                                            "../x",
                                            copy.string(),
                                            "/etc/passwd",
                                            "a/b",
                                            "..",
                                            "",
                                            "h.ckpt." + gen + ".1.0000000a.shard0/../../" +
                                                relative,
                                            "h.ckpt." + gen + ".1.0000000a.shard1",
                                            "x.ckpt." + gen + ".1.0000000a.shard0",
                                            "h.ckpt.0123456789abcdef.1.0000000a.shard0"};
    // Section names must not change between runs (the paths and the generation do).
    for (std::size_t i = 0; i < names.size(); ++i) {
        const std::string& name = names[i];
        DYNAMIC_SECTION("hostile shard.0.file #" << i) {
            INFO(name);
            set_marker_value(path, "shard.0.file", name);
            refused_with(std::string("shard.0.file '").append(name).append(not_a_shard));
        }
    }
    SECTION("a symbolic link of the expected name to a valid shard outside") {
        const std::string name = "h.ckpt." + gen + ".1.0000000a.shard0";
        fs::create_symlink(copy, dir.path / name);
        set_marker_value(path, "shard.0.file", name);
        refused_with("is a symbolic link");
    }
    SECTION("a size one byte larger than the file") {
        const std::string bigger = std::to_string(std::stoull(size) + 1);
        set_marker_value(path, "shard.0.size", bigger);
        refused_with("shard.0.size " + bigger + ": shard '" + shard.string() + "' has " + size +
                     " bytes, the commit marker records " + bigger);
    }
    SECTION("a size of 1 GiB with a small file: refused by its size, before any read") {
        set_marker_value(path, "shard.0.size", "1073741824");
        refused_with("' has " + size + " bytes, the commit marker records 1073741824");
    }
    SECTION("sizes and CRCs that are not numbers") {
        for (const std::string& v : {std::string("-1"), std::string("0x10"), std::string(" 12"),
                                     std::string("99999999999999999999999")}) {
            set_marker_value(path, "shard.0.size", v);
            refused_with("shard.0.size '" + v + "' is not a byte count");
        }
        set_marker_value(path, "shard.0.crc32c", "4294967296");
        refused_with("shard.0.crc32c '4294967296' is not a CRC32C");
    }
    // Nothing of that removed or changed the checkpoint or the file outside.
    CHECK(load_single(path).loaded == saved);
    CHECK(read_all(copy) == read_all(shard));
}

TEST_CASE("a FIFO at the marker's path is refused without blocking the load",
          "[train][checkpoint][thread]") {
    temp_dir dir;
    const fs::path path = dir.path / "fifo.ckpt";
    REQUIRE(::mkfifo(path.c_str(), 0644) == 0);
    // The load runs beside this thread: an open that blocks on the FIFO (no writer) makes the
    // wait time out here instead of hanging the test; the blocked opens are then released by
    // opening the FIFO for writing, so that the load ends either way.
    auto load = std::async(std::launch::async, [&] { return load_single(path); });
    const bool finished = load.wait_for(std::chrono::seconds(10)) == std::future_status::ready;
    for (int i = 0;
         i < 1000 && load.wait_for(std::chrono::milliseconds(10)) != std::future_status::ready;
         ++i) {
        const int fd = ::open(path.c_str(), O_WRONLY | O_NONBLOCK | O_CLOEXEC);
        if (fd >= 0)
            ::close(fd);
    }
    const load_outcome o = load.get();
    INFO(o.message);
    CHECK(finished);
    CHECK(o.unchanged);
    CHECK(o.message.find("load_checkpoint: checkpoint '" + path.string() + "' refused") !=
          std::string::npos);
    CHECK(o.message.find("'" + path.string() + "' is not a regular file") != std::string::npos);
}

TEST_CASE("a checkpoint with the first format's shard names still loads",
          "[train][checkpoint][thread]") {
    temp_dir dir;
    const fs::path path = dir.path / "old.ckpt";
    const auto saved = save_single(path);
    const std::string legacy = "old.ckpt." + marker_value(path, "generation") + ".shard0";
    fs::rename(shard_file(path, 0), dir.path / legacy);
    set_marker_value(path, "shard.0.file", legacy);
    const load_outcome o = load_single(path);
    INFO(o.message);
    CHECK(o.message.empty());
    CHECK(o.loaded == saved);
}

TEST_CASE("two jobs saving to one path concurrently leave a checkpoint of one of them",
          "[train][checkpoint][thread]") {
    temp_dir dir;
    const fs::path path = dir.path / "shared.ckpt";
    constexpr int rounds = 40;
    constexpr int replicas = 2;
    // [job][round][replica]
    std::vector<std::vector<std::vector<std::vector<std::byte>>>> saved(
        2, std::vector<std::vector<std::vector<std::byte>>>(
               rounds, std::vector<std::vector<std::byte>>(replicas)));
    std::vector<std::string> failures;
    std::mutex failures_mutex;
    // Both jobs' replicas and this thread: start of the saves, end of the saves, loaded.
    std::barrier sync(2 * replicas + 1);
    auto job = [&](int j) {
        thread_group(replicas).run([&](thread_communicator& comm) {
            dp_type dp(comm, [](auto& ctx) { return net(ctx); }, opt_params,
                       {.seed = static_cast<std::uint64_t>(11 + j)});
            for (int round = 0; round < rounds; ++round) {
                step_once(dp);
                saved[j][round][comm.rank()] = fingerprint(dp);
                sync.arrive_and_wait();
                try {
                    save_checkpoint(dp, path);
                } catch (const std::exception& e) {
                    std::lock_guard lock(failures_mutex);
                    failures.emplace_back(e.what());
                }
                sync.arrive_and_wait();
                sync.arrive_and_wait();
            }
        });
    };
    std::thread a(job, 0), b(job, 1);
    std::vector<int> which(rounds, -1);
    for (int round = 0; round < rounds; ++round) {
        sync.arrive_and_wait();
        sync.arrive_and_wait();
        std::vector<std::vector<std::byte>> loaded(replicas);
        std::string message;
        try {
            thread_group(replicas).run([&](thread_communicator& comm) {
                dp_type dp(comm, [](auto& ctx) { return net(ctx); }, opt_params, {.seed = 5});
                load_checkpoint(dp, path);
                loaded[comm.rank()] = fingerprint(dp);
            });
        } catch (const std::exception& e) {
            message = e.what();
        }
        for (int j = 0; j < 2; ++j)
            if (loaded == saved[j][round])
                which[round] = j;
        INFO("round " << round << ": " << message);
        CHECK(which[round] >= 0);
        sync.arrive_and_wait();
    }
    a.join();
    b.join();
    CHECK(failures.empty());
    for (const auto& f : failures)
        WARN(f);
    CHECK(saved[0][0] != saved[1][0]); // the jobs' states differ: the comparison tells them apart
    // One more save leaves only its own files: the marker and two shards.
    thread_group(replicas).run([&](thread_communicator& comm) {
        dp_type dp(comm, [](auto& ctx) { return net(ctx); }, opt_params, {.seed = 5});
        load_checkpoint(dp, path);
        save_checkpoint(dp, path);
    });
    std::size_t files = 0;
    for (const auto& e : fs::directory_iterator(dir.path)) {
        (void)e;
        ++files;
    }
    CHECK(files == 3);
}

namespace {

/// Two saves of 2 shards each to one marker path, their shards written and none committed: the
/// older one a lost replica 0 commits late, the newer one its survivors commit meanwhile.
struct late_and_newer_save {
    temp_dir dir;
    fs::path path = dir.path / "x.ckpt";
    ck::save_id older{0x1111111111111111u, ck::this_process()};
    ck::save_id newer{0x2222222222222222u, ck::this_process()};
    std::vector<ck::shard_record> records = std::vector<ck::shard_record>(2, {0, 16});

    late_and_newer_save() {
        const std::vector<std::byte> bytes(16, std::byte{1});
        for (const ck::save_id* id : {&older, &newer})
            for (int r = 0; r < 2; ++r)
                write_all(ck::shard_path(path, *id, r), bytes);
    }
    /// The late writer's commit of the older save; what it threw ("" when nothing).
    std::string commit_late(const ck::stage_hook& hook = {}) const {
        try {
            ck::commit_save(path, older, records, hook);
        } catch (const lockstep::error& e) {
            return e.what();
        }
        return "";
    }
    /// The late commit was refused and the newer save stands, marker and shards.
    void check_refused(const std::string& message) const {
        INFO(message);
        CHECK(contains(message, "not committed"));
        CHECK(ck::committed_generation(path) == std::optional(newer.gen));
        for (int r = 0; r < 2; ++r)
            CHECK(fs::exists(ck::shard_path(path, newer, r)));
    }
};

} // namespace

TEST_CASE("a save revoked after a shrink never commits over the save that followed it",
          "[train][checkpoint]") {
    // The order a lost replica 0's background marker writer can produce: the survivors decide
    // its save (older) failed, commit a newer one to the same path, and only then does the late
    // writer reach its commit. It must be refused, leaving the newer marker and shards in place.
    const late_and_newer_save f;
    CHECK_FALSE(ck::commit_or_revoke(f.path, f.older, 2)); // the survivors: not committed, revoked
    ck::commit_save(f.path, f.newer, f.records, {});       // their newer save
    CHECK(ck::commit_or_revoke(f.path, f.newer, 2));       // a committed save is left alone
    f.check_refused(f.commit_late());
}

TEST_CASE("a save revoked while its late commit writes the marker is refused under the lock",
          "[train][checkpoint]") {
    // The late writer passes its first shard check, and while it writes the marker's temporary
    // (stage manifest.written, before it takes the commit lock) the survivors revoke its save and
    // commit a newer one. Its check under the lock must refuse it and remove the temporary.
    const late_and_newer_save f;
    bool temp_written = false, revoked = true;
    const ck::stage_hook survivors_meanwhile = [&](std::string_view stage, int) {
        if (stage != "manifest.written")
            return;
        temp_written = fs::exists(ck::marker_temp_path(f.path, f.older));
        revoked = !ck::commit_or_revoke(f.path, f.older, 2);
        ck::commit_save(f.path, f.newer, f.records, {});
    };
    f.check_refused(f.commit_late(survivors_meanwhile));
    CHECK(temp_written);
    CHECK(revoked);
    // The refused commit leaves no marker temporary behind.
    CHECK_FALSE(fs::exists(ck::marker_temp_path(f.path, f.older)));
}
