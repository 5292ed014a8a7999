// tests/train/checkpoint_support.hpp: helpers of the checkpoint tests: a trainer fingerprint,
// temporary directories, and rewriting a shard so that only a deliberate edit differs.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/train/checkpoint.hpp"

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <span>
#include <stdexcept>
#include <string>
#include <system_error>
#include <vector>

#include <catch2/catch.hpp>
#include <fcntl.h>
#include <unistd.h>

namespace lockstep_test {

namespace fs = std::filesystem;
namespace ck = lockstep::detail::ckpt;

/// A fresh empty directory, removed with its content at scope exit.
struct temp_dir {
    fs::path path;
    explicit temp_dir(const std::string& tag = "t") {
        static int n = 0;
        path = fs::temp_directory_path() /
               ("lockstep_ckpt_" + std::to_string(::getpid()) + "_" + tag + std::to_string(n++));
        fs::remove_all(path);
        fs::create_directories(path);
    }
    temp_dir(const temp_dir&) = delete;
    temp_dir& operator=(const temp_dir&) = delete;
    ~temp_dir() {
        std::error_code ec;
        fs::remove_all(path, ec);
    }
};

template <class S>
void append_bytes(std::vector<std::byte>& out, S s) {
    const auto* b = reinterpret_cast<const std::byte*>(s.data());
    out.insert(out.end(), b, b + s.size_bytes());
}

/// Every bit a later step depends on, as bytes: the flat parameters, the network's own parameter
/// buffers (visitor), the BN running statistics, the optimizer's buffers and step count,
/// steps() and the RNG seed.
template <class DP>
std::vector<std::byte> fingerprint(DP& dp) {
    std::vector<std::byte> out;
    append_bytes(out, dp.parameters());
    using T = typename DP::value_type;
    if constexpr (DP::uses_visitor)
        dp.network().for_each_parameter(
            [&](auto, std::span<T> v, std::span<T>) { append_bytes(out, v); });
    auto& bn = dp.network().batch_norm();
    append_bytes(out, bn.running_mean());
    append_bytes(out, bn.running_var());
    for (auto& slot : dp.optimizer().state().slots)
        append_bytes(out, slot.data);
    const std::uint64_t c[3] = {static_cast<std::uint64_t>(dp.optimizer().step_count()),
                                static_cast<std::uint64_t>(dp.steps()), dp.context().seed()};
    append_bytes(out, std::span<const std::uint64_t>(c));
    return out;
}

inline std::vector<std::byte> read_all(const fs::path& p) {
    return ck::read_file(p, -1);
}
/// Replaces p's content with b. Overwrites in place and then sets the size, instead of
/// truncating to zero first: ext4 flushes a file truncated to zero when it is closed
/// (auto_da_alloc), which would make the thousands of rewrites of the corruption tests slow.
/// Throws std::runtime_error on failure (no Catch2 assertion: replica threads call it too).
inline void write_all(const fs::path& p, std::span<const std::byte> b) {
    const auto fail = [&](const char* what) {
        throw std::runtime_error("write_all(" + p.string() + "): " + what + " failed");
    };
    ck::fd_guard f{::open(p.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0644)};
    if (f.fd < 0)
        fail("open");
    std::size_t done = 0;
    while (done < b.size()) {
        const ::ssize_t w = ::write(f.fd, b.data() + done, b.size() - done);
        if (w <= 0)
            fail("write");
        done += static_cast<std::size_t>(w);
    }
    if (::ftruncate(f.fd, static_cast<::off_t>(b.size())) != 0)
        fail("ftruncate");
}

/// The shard file of replica r named by the commit marker `path`.
inline fs::path shard_file(const fs::path& path, int r) {
    const auto m = read_all(path);
    const auto h = ck::parse_header(m, ck::manifest_magic, "marker");
    return path.parent_path() / *h.find_meta("shard." + std::to_string(r) + ".file");
}

/// Writes `bytes` as replica r's shard and records its size and CRC32C in the commit marker, so
/// that the marker no longer detects the change (the shard's own checks must).
inline void commit_shard(const fs::path& path, int r, std::span<const std::byte> bytes) {
    const fs::path file = shard_file(path, r);
    write_all(file, bytes);
    const auto m = read_all(path);
    const auto h = ck::parse_header(m, ck::manifest_magic, "marker");
    ck::file_builder b;
    const std::string key = "shard." + std::to_string(r);
    for (std::size_t i = 0; i < h.meta_count(); ++i) {
        auto [k, v] = h.meta(i);
        std::string value(v);
        if (k == key + ".size")
            value = std::to_string(bytes.size());
        if (k == key + ".crc32c")
            value = std::to_string(lockstep::crc32c(bytes));
        b.meta(std::string(k), value);
    }
    write_all(path, b.finish(ck::manifest_magic));
}

/// Re-encodes the commit marker `path` after edit(meta) (a valid marker: its CRC matches).
inline void
rewrite_marker(const fs::path& path,
               const std::function<void(std::vector<std::pair<std::string, std::string>>&)>& edit) {
    const auto m = read_all(path);
    const auto h = ck::parse_header(m, ck::manifest_magic, "marker");
    std::vector<std::pair<std::string, std::string>> meta;
    for (std::size_t i = 0; i < h.meta_count(); ++i) {
        auto [k, v] = h.meta(i);
        meta.emplace_back(std::string(k), std::string(v));
    }
    edit(meta);
    ck::file_builder b;
    for (auto& [k, v] : meta)
        b.meta(k, v);
    write_all(path, b.finish(ck::manifest_magic));
}

/// Sets the marker's metadata entry `key` to `value`.
inline void set_marker_value(const fs::path& path, const std::string& key,
                             const std::string& value) {
    rewrite_marker(path, [&](auto& meta) {
        for (auto& [k, v] : meta)
            if (k == key)
                v = value;
    });
}

/// One section of a shard being edited.
struct raw_section {
    std::string name;
    ck::dtype type;
    std::vector<std::uint64_t> shape;
    std::vector<std::byte> bytes;
};

/// Re-encodes replica r's shard after edit(meta, sections) and commits it (valid CRCs).
inline void
rewrite_shard(const fs::path& path, int r,
              const std::function<void(std::vector<std::pair<std::string, std::string>>&,
                                       std::vector<raw_section>&)>& edit) {
    const auto bytes = read_all(shard_file(path, r));
    const auto h = ck::parse_header(bytes, ck::shard_magic, "shard");
    std::vector<std::pair<std::string, std::string>> meta;
    for (std::size_t i = 0; i < h.meta_count(); ++i) {
        auto [k, v] = h.meta(i);
        meta.emplace_back(std::string(k), std::string(v));
    }
    std::vector<raw_section> secs;
    for (std::size_t i = 0; i < h.section_count(); ++i) {
        const ck::section_entry e = h.section(i);
        const auto* p = bytes.data() + e.offset;
        secs.push_back({e.name, e.type, e.shape, std::vector<std::byte>(p, p + e.length)});
    }
    edit(meta, secs);
    ck::file_builder b;
    for (auto& [k, v] : meta)
        b.meta(k, v);
    for (auto& s : secs)
        b.raw_section(s.name, s.type, s.shape, s.bytes);
    commit_shard(path, r, b.finish(ck::shard_magic));
}

} // namespace lockstep_test
