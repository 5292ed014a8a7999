// Fuzz test of the commit marker's reading (train/detail/checkpoint_marker.hpp): a deterministic
// mutator over a valid marker (its shard entries replaced by names leading out of the directory,
// symbolic links, other ranks and generations, numbers of every size; bytes flipped with the
// header CRC recomputed) and hand-made hostile markers. Every input is refused with
// lockstep::error (checkpoint) or a problem, or reads exactly the committed shard; no allocation
// exceeds the larger of the marker and the shard (or 4 KiB, the room messages need), so nothing
// outside the directory is read; a reduce::sharded checkpoint claiming a huge world size is
// refused with no allocation beyond its files' sizes. Run under the asan preset (ASan + UBSan)
// in CI.
// SPDX-License-Identifier: Apache-2.0
// The replacement operator new/delete below pair malloc with free; GCC's heuristic does not see
// through the replacement and warns at every inlined std::allocator call.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
#endif
#include <catch2/catch.hpp>

#include "lockstep/train/detail/checkpoint_marker.hpp"

#include "checkpoint_support.hpp"
#include "train_runner.hpp"

#include "lockstep/optim/sgd.hpp"
#include "lockstep/train/checkpoint.hpp"

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <new>
#include <string>
#include <vector>

#include <fcntl.h>
#include <unistd.h>

#include "allocation_tracker.hpp"
#include "support/splitmix64.hpp"

namespace {

namespace ck = lockstep::detail::ckpt;
namespace fs = std::filesystem;
using bytes = std::vector<std::byte>;
using lockstep_test::read_all;
using lockstep_test::temp_dir;
using lockstep_test::write_all;

constexpr std::size_t message_room = 4096;

/// What reading replica 0's shard through one marker did.
struct outcome {
    bool read = false;    ///< the shard was read and matches the marker
    bool refused = false; ///< a problem, or lockstep::error with errc::checkpoint
    std::string message;
    fs::path file;
    bytes shard;
    std::size_t largest_allocation = 0;
};

/// The generation of the fixture's save (the one every mutated marker is read against).
constexpr std::uint64_t fixture_gen = 0x0123456789abcdefull;

outcome read_through(const fs::path& marker) {
    outcome o;
    largest = 0;
    tracking = true;
    try {
        const auto problems = ck::read_committed_shard(marker, 0, 1, fixture_gen, o.shard, o.file);
        o.read = problems.empty() && !o.file.empty();
        o.refused = !problems.empty();
        if (!problems.empty())
            o.message = problems.front();
    } catch (const lockstep::error& e) {
        o.refused = e.code() == lockstep::errc::checkpoint;
        o.message = e.what();
    }
    tracking = false;
    o.largest_allocation = largest;
    return o;
}

using meta_list = std::vector<std::pair<std::string, std::string>>;

bytes encode(const meta_list& meta) {
    ck::file_builder b;
    for (const auto& [k, v] : meta)
        b.meta(k, v);
    return b.finish(ck::manifest_magic);
}

/// splitmix64: a deterministic stream of random words.
using rng = lockstep_test::splitmix64;

/// A checkpoint directory `<root>/ckpt` with the marker m.ckpt and a valid shard, next to an
/// outside file of 64 KiB (a size the mutations record) and, in the directory, a symbolic link
/// of the expected name form to it.
struct fixture {
    temp_dir root{"fuzzmarker"};
    fs::path dir = root.path / "ckpt";
    fs::path marker = dir / "m.ckpt";
    ck::save_id id{fixture_gen, {4242, 0xdeadbeefu}};
    std::string shard_name;
    std::string link_name;
    bytes shard;
    bytes outside;
    meta_list good;
    fixture() {
        fs::create_directories(dir);
        shard_name = ck::shard_path(marker, id, 0).filename().string();
        for (int i = 0; i < 300; ++i)
            shard.push_back(std::byte(i * 7));
        write_all(dir / shard_name, shard);
        outside.assign(65536, std::byte{0x5A});
        write_all(root.path / "big_outside.bin", outside);
        link_name = ck::shard_path(marker, {id.gen, {4242, 0xfeedfaceu}}, 0).filename().string();
        fs::create_symlink(root.path / "big_outside.bin", dir / link_name);
        good = {{"generation", ck::hex16(id.gen)},
                {"world_size", "1"},
                {"shard.0.file", shard_name},
                {"shard.0.size", std::to_string(shard.size())},
                {"shard.0.crc32c", std::to_string(lockstep::crc32c(std::span(shard)))}};
    }
};

} // namespace

TEST_CASE("the commit marker's reading survives a deterministic mutation fuzz",
          "[train][checkpoint][fuzz]") {
    fixture fx;
    write_all(fx.marker, encode(fx.good));
    {
        const outcome o = read_through(fx.marker);
        INFO(o.message);
        REQUIRE(o.read);
        REQUIRE(o.shard == fx.shard);
    }
    // Pieces the names and numbers are made of.
    const std::vector<std::string> pieces = {"..",
                                             "/",
                                             ".",
                                             "big_outside.bin",
                                             "../big_outside.bin",
                                             "/etc/passwd",
                                             fx.shard_name,
                                             fx.link_name,
                                             "m.ckpt",
                                             ck::hex16(fx.id.gen),
                                             "4242",
                                             "deadbeef",
                                             "feedface",
                                             "shard0",
                                             "shard1",
                                             "tmp",
                                             "marker",
                                             std::string(1, '\0'),
                                             "65536",
                                             "300",
                                             "1073741824",
                                             "18446744073709551615",
                                             "18446744073709551616",
                                             "-1",
                                             "0",
                                             " "};
    const char* keys[] = {"generation", "world_size", "shard.0.file", "shard.0.size",
                          "shard.0.crc32c"};
    rng r{2026};
    std::size_t reads = 0, refusals = 0;
    constexpr int iterations = 20000;
    for (int it = 0; it < iterations; ++it) {
        meta_list meta = fx.good;
        const std::size_t edits = 1 + r.below(3);
        for (std::size_t e = 0; e < edits; ++e) {
            auto& value = meta[r.below(meta.size())].second;
            switch (r.below(5)) {
            case 0: // a value made of pieces
                value.clear();
                for (std::size_t n = 1 + r.below(4); n > 0; --n)
                    value += pieces[r.below(pieces.size())];
                break;
            case 1: // the valid name with a piece spliced in
                value = fx.shard_name;
                value.insert(r.below(value.size() + 1), pieces[r.below(pieces.size())]);
                break;
            case 2: // one character changed
                if (!value.empty())
                    value[r.below(value.size())] = static_cast<char>(r.below(256));
                break;
            case 3: // a piece
                value = pieces[r.below(pieces.size())];
                break;
            default: // a key removed
                meta.erase(meta.begin() + static_cast<std::ptrdiff_t>(r.below(meta.size())));
                break;
            }
            if (meta.empty())
                break;
        }
        if (r.below(8) == 0)
            meta.emplace_back(keys[r.below(5)], pieces[r.below(pieces.size())]);
        bytes file;
        try {
            file = encode(meta);
        } catch (const lockstep::error&) {
            continue; // a key set twice: the builder refuses it
        }
        if (r.below(6) == 0 && file.size() > ck::min_header_bytes) {
            // A flipped byte with the header CRC recomputed.
            file[r.below(file.size() - 4)] ^= std::byte(1u << r.below(8));
            const std::uint64_t h = ck::get_u64(file.data() + 16);
            if (h >= ck::min_header_bytes && h <= file.size()) {
                const std::uint32_t c =
                    lockstep::crc32c(std::span<const std::byte>(file).first(h - 4));
                for (int i = 0; i < 4; ++i)
                    file[h - 4 + i] = std::byte((c >> (8 * i)) & 0xFF);
            }
        }
        write_all(fx.marker, file);
        const outcome o = read_through(fx.marker);
        INFO("iteration " << it << ": " << o.message);
        REQUIRE(o.read != o.refused);
        // Only the committed shard is ever read, and no allocation exceeds the files involved.
        if (o.read) {
            REQUIRE(o.file == fx.dir / fx.shard_name);
            REQUIRE(o.shard == fx.shard);
        }
        REQUIRE(o.largest_allocation <= std::max({file.size(), fx.shard.size(), message_room}));
        reads += o.read ? 1 : 0;
        refusals += o.refused ? 1 : 0;
    }
    // The mutations reach both outcomes (most are refused).
    CHECK(reads > 0);
    CHECK(refusals > iterations / 2);
    CHECK(read_all(fx.root.path / "big_outside.bin") == fx.outside);
}

TEST_CASE("hand-made hostile markers are refused before any large allocation",
          "[train][checkpoint][fuzz]") {
    fixture fx;
    // A sparse 1 GiB file outside the directory, and a link of the expected form to it.
    const fs::path big = fx.root.path / "big_1g.bin";
    {
        ck::fd_guard f{::open(big.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0644)};
        REQUIRE(f.fd >= 0);
        REQUIRE(::ftruncate(f.fd, ::off_t{1} << 30) == 0);
    }
    const std::string big_link =
        ck::shard_path(fx.marker, {fx.id.gen, {1, 2}}, 0).filename().string();
    fs::create_symlink(big, fx.dir / big_link);
    struct hostile {
        const char* what;
        std::string file;
        std::string size;
        std::string expected;
    };
    const hostile cases[] = {
        {"../ to a 1 GiB file", "../big_1g.bin", "1073741824", "is not the name of a shard"},
        {"absolute path", big.string(), "1073741824", "is not the name of a shard"},
        {"a link to a 1 GiB file", big_link, "1073741824", "is a symbolic link"},
        {"1 GiB recorded for the small shard", fx.shard_name, "1073741824",
         "has 300 bytes, the commit marker records 1073741824"},
        {"2^64 - 1 recorded", fx.shard_name, "18446744073709551615",
         "the commit marker records 18446744073709551615"},
        {"a directory", "..", "4096", "is not the name of a shard"},
    };
    for (const hostile& c : cases) {
        INFO(c.what);
        meta_list meta = fx.good;
        meta[2].second = c.file;
        meta[3].second = c.size;
        const bytes file = encode(meta);
        write_all(fx.marker, file);
        const outcome o = read_through(fx.marker);
        INFO(o.message);
        CHECK(o.refused);
        CHECK(o.message.find("commit marker '" + fx.marker.string() + "': shard.0.") !=
              std::string::npos);
        CHECK(o.message.find(c.expected) != std::string::npos);
        CHECK(o.largest_allocation <= std::max(file.size(), message_room));
    }
}

TEST_CASE("a reduce::sharded checkpoint claiming a huge world size is refused without large "
          "allocations",
          "[train][checkpoint][fuzz]") {
    using net =
        lockstep_test::mlp<float, lockstep::thread_communicator, lockstep_test::storage::registry>;
    using dp_type =
        lockstep::data_parallel<net, lockstep::optim::sgd<float>, lockstep::sync::synchronous,
                                lockstep::reduce::sharded<>, lockstep::thread_communicator>;
    const lockstep::optim::sgd_params sgd{.lr = 0.05, .momentum = 0.9};
    temp_dir dir{"hugeworld"};
    const fs::path path = dir.path / "z.ckpt";
    lockstep::thread_group(1).run([&](lockstep::thread_communicator& comm) {
        dp_type dp(comm, [](auto& ctx) { return net(ctx); }, sgd, {.seed = 42});
        dp.step(8,
                [](net& n, const lockstep::shard_range& r, auto& ctx) { return n.train(r, ctx); });
        lockstep::save_checkpoint(dp, path);
    });
    // The marker and shard 0 claim 2^20 replicas (a shard_layout of that many extents is 16 MiB;
    // a world of 2^31 - 1 would be 32 GiB).
    const std::string huge = std::to_string(1 << 20);
    lockstep_test::set_marker_value(path, "world_size", huge);
    const bool consistent = GENERATE(false, true);
    // consistent: shard 0 is also the first shard of that world (one optimizer element), so that
    // only the missing shards of the other replicas refuse it.
    lockstep_test::rewrite_shard(path, 0,
                                 [&](auto& meta, std::vector<lockstep_test::raw_section>& s) {
                                     for (auto& [k, v] : meta) {
                                         if (k == "world_size")
                                             v = huge;
                                         if (k == "reduce.shard" && consistent)
                                             v = "[0, 1) of " + v.substr(v.find("of ") + 3);
                                     }
                                     for (lockstep_test::raw_section& x : s)
                                         if (consistent && x.name == "optimizer.momentum") {
                                             x.shape = {1};
                                             x.bytes.resize(sizeof(float));
                                         }
                                 });
    const std::size_t files =
        std::max(read_all(path).size(), read_all(lockstep_test::shard_file(path, 0)).size());
    // Two replicas load it (another replica count: the regathering of the optimizer state).
    std::vector<std::string> messages(2);
    std::vector<int> refused(2);
    lockstep::thread_group(2).run([&](lockstep::thread_communicator& comm) {
        const auto r = static_cast<std::size_t>(comm.rank());
        dp_type dp(comm, [](auto& ctx) { return net(ctx); }, sgd, {.seed = 7});
        comm.barrier();
        if (r == 0) {
            largest = 0;
            tracking = true;
        }
        comm.barrier();
        try {
            lockstep::load_checkpoint(dp, path);
        } catch (const lockstep::error& e) {
            refused[r] = e.code() == lockstep::errc::checkpoint;
            messages[r] = e.what();
        }
        comm.barrier();
        if (r == 0)
            tracking = false;
    });
    const std::size_t largest_allocation = largest.exchange(0);
    INFO("consistent: " << consistent << ", largest allocation " << largest_allocation);
    CHECK(refused == std::vector<int>{1, 1});
    for (const std::string& m : messages) {
        INFO(m);
        CHECK(m.find(consistent ? "the commit marker lists no shard for replica 1"
                                : "reduce.shard: checkpoint [0, ") != std::string::npos);
    }
    CHECK(largest_allocation <= std::max(files, message_room));
}
