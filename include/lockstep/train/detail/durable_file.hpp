// lockstep/train/detail/durable_file.hpp: durable POSIX file I/O for checkpoints: a write that
// replaces a file atomically (temporary, fsync, rename, directory fsync) and a whole-file read.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/error.hpp"
#include "lockstep/train/detail/checkpoint_format.hpp"

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstring>
#include <filesystem>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

namespace lockstep::detail::ckpt {

/// Called at each stage of a save (see docs/checkpoints.md) with the stage's name and the
/// replica; a hook that throws simulates a crash at that point (the crash tests' fault
/// injection, given to save_checkpoint through save_options). Empty in normal use.
using stage_hook = std::function<void(std::string_view stage, int replica)>;

/// Runs hook at stage `name` when there is one.
inline void stage(const stage_hook& hook, std::string_view name, int replica) {
    if (hook)
        hook(name, replica);
}

/// A file descriptor closed on scope exit.
struct fd_guard {
    int fd = -1;
    ~fd_guard() {
        if (fd >= 0)
            ::close(fd);
    }
};

[[noreturn]] inline void fail_errno(int replica, std::string_view what,
                                    const std::filesystem::path& p) {
    const int e = errno;
    fail(errc::checkpoint, replica, "checkpoint", what, " '", p.string(), "': ", std::strerror(e));
}

/// fsync of the directory holding p, so a rename in it is durable.
inline void sync_directory(const std::filesystem::path& p, int replica) {
    std::filesystem::path dir = p.parent_path();
    if (dir.empty())
        dir = ".";
    fd_guard d{::open(dir.c_str(), O_RDONLY | O_DIRECTORY)};
    if (d.fd < 0)
        fail_errno(replica, "cannot open directory", dir);
    if (::fsync(d.fd) != 0)
        fail_errno(replica, "cannot fsync directory", dir);
}

/// The first half of write_durably: writes the concatenation of `pieces` to the new file `tmp`
/// (a name unique to this write: an existing one is an error) and fsyncs it; stages
/// `<stage_prefix>.partial` (half written) and `.written` (complete and fsynced) (hook); `pace`
/// (if any) is called after every write of at most slice_bytes.
inline void write_temp_durably(const std::filesystem::path& tmp,
                               std::span<const std::span<const std::byte>> pieces, int replica,
                               std::string_view stage_prefix, const stage_hook& hook = {},
                               const std::function<void()>& pace = {}) {
    std::size_t total = 0;
    for (const auto& piece : pieces)
        total += piece.size();
    const std::size_t half = std::max<std::size_t>(total / 2, 1);
    {
        fd_guard f{::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644)};
        if (f.fd < 0)
            fail_errno(replica, "cannot create", tmp);
        std::size_t done = 0;
        bool staged_half = false;
        for (const auto& piece : pieces) {
            std::size_t at = 0;
            while (at < piece.size()) {
                std::size_t chunk = std::min(piece.size() - at, slice_bytes);
                if (!staged_half)
                    chunk = std::min(chunk, half - done);
                const ::ssize_t w = ::write(f.fd, piece.data() + at, chunk);
                if (w < 0) {
                    if (errno == EINTR)
                        continue;
                    fail_errno(replica, "cannot write", tmp);
                }
                at += static_cast<std::size_t>(w);
                done += static_cast<std::size_t>(w);
                if (!staged_half && done >= half) {
                    staged_half = true;
                    stage(hook, std::string(stage_prefix) + ".partial", replica);
                }
                if (pace)
                    pace();
            }
        }
        if (::fsync(f.fd) != 0)
            fail_errno(replica, "cannot fsync", tmp);
    }
    stage(hook, std::string(stage_prefix) + ".written", replica);
}

/// The second half of write_durably: renames the complete temporary `tmp` to target and fsyncs
/// the directory; stages `<stage_prefix>.renamed` (hook).
inline void rename_durably(const std::filesystem::path& tmp, const std::filesystem::path& target,
                           int replica, std::string_view stage_prefix,
                           const stage_hook& hook = {}) {
    if (::rename(tmp.c_str(), target.c_str()) != 0)
        fail_errno(replica, "cannot rename to " + target.string() + " from", tmp);
    sync_directory(target, replica);
    stage(hook, std::string(stage_prefix) + ".renamed", replica);
}

/// Writes the concatenation of `pieces` to the new file `tmp` (a name unique to this write: an
/// existing one is an error), fsyncs it, renames it to target and fsyncs the directory; stages
/// `<stage_prefix>.partial` (half written), `.written` (complete and fsynced, not yet renamed)
/// and `.renamed` (hook); `pace` (if any) is called after every write of at most slice_bytes.
/// ensures: target holds either its old content or all of the bytes, whatever point a crash
/// happens at.
inline void write_durably(const std::filesystem::path& target, const std::filesystem::path& tmp,
                          std::span<const std::span<const std::byte>> pieces, int replica,
                          std::string_view stage_prefix, const stage_hook& hook = {},
                          const std::function<void()>& pace = {}) {
    write_temp_durably(tmp, pieces, replica, stage_prefix, hook, pace);
    rename_durably(tmp, target, replica, stage_prefix, hook);
}

/// write_durably of one piece.
inline void write_durably(const std::filesystem::path& target, const std::filesystem::path& tmp,
                          std::span<const std::byte> bytes, int replica,
                          std::string_view stage_prefix, const stage_hook& hook = {}) {
    const std::span<const std::byte> one[1] = {bytes};
    write_durably(target, tmp, std::span<const std::span<const std::byte>>(one), replica,
                  stage_prefix, hook);
}

/// The whole content of a regular file (allocates exactly its size); anything else (a FIFO, a
/// device, a directory) throws lockstep::error (checkpoint) without blocking.
inline std::vector<std::byte> read_file(const std::filesystem::path& p, int replica) {
    // O_NONBLOCK: opening a FIFO does not wait for a writer (no effect on a regular file).
    fd_guard f{::open(p.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK)};
    if (f.fd < 0)
        fail_errno(replica, "cannot open", p);
    struct ::stat st {};
    if (::fstat(f.fd, &st) != 0)
        fail_errno(replica, "cannot stat", p);
    if (!S_ISREG(st.st_mode))
        fail(errc::checkpoint, replica, "checkpoint", "'", p.string(), "' is not a regular file");
    std::vector<std::byte> out(static_cast<std::size_t>(st.st_size));
    std::size_t done = 0;
    while (done < out.size()) {
        const ::ssize_t r = ::read(f.fd, out.data() + done, out.size() - done);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0)
            fail_errno(replica, "cannot read", p);
        if (r == 0)
            fail(errc::checkpoint, replica, "checkpoint", "'", p.string(), "' shrank while read");
        done += static_cast<std::size_t>(r);
    }
    return out;
}

} // namespace lockstep::detail::ckpt
