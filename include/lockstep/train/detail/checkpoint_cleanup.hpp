// lockstep/train/detail/checkpoint_cleanup.hpp: the saves in flight in this process and the
// clean-up after a commit that concurrent saves survive. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/train/detail/checkpoint_format.hpp"
#include "lockstep/train/detail/checkpoint_names.hpp"
#include "lockstep/train/detail/checkpoint_parser.hpp"
#include "lockstep/train/detail/durable_file.hpp"

#include <chrono>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

namespace lockstep::detail::ckpt {

/// The generations of saves running in this process, from before replica 0 publishes one until
/// the save returns: clean-up never removes their files.
struct inflight_saves {
    std::mutex mutex;
    std::multiset<std::uint64_t> gens;
    static inflight_saves& get() {
        static inflight_saves s;
        return s;
    }
};

/// Registers a generation as in flight for its lifetime (replica 0 only: active == false does
/// nothing).
class inflight_scope {
public:
    inflight_scope(std::uint64_t gen, bool active) : gen_(gen), active_(active) {
        if (active_) {
            std::lock_guard lock(inflight_saves::get().mutex);
            inflight_saves::get().gens.insert(gen_);
        }
    }
    inflight_scope(const inflight_scope&) = delete;
    inflight_scope& operator=(const inflight_scope&) = delete;
    ~inflight_scope() {
        if (active_) {
            std::lock_guard lock(inflight_saves::get().mutex);
            auto& g = inflight_saves::get().gens;
            g.erase(g.find(gen_));
        }
    }

private:
    std::uint64_t gen_;
    bool active_;
};

/// The generation the commit marker `path` names now, if it can be read.
inline std::optional<std::uint64_t> committed_generation(const std::filesystem::path& path) {
    try {
        const std::vector<std::byte> bytes = read_file(path, 0);
        const parsed_header m = parse_header(bytes, manifest_magic, "commit marker", 0);
        if (const auto g = m.find_meta("generation"))
            return name_detail::number(*g, 16, 16);
    } catch (const std::exception&) {
    }
    return std::nullopt;
}

/// Files of another process's saves younger than this may belong to a save in flight.
inline constexpr std::chrono::hours stale_after{24};

/// After the save `ours` committed (replica 0): removes the files of other saves of `path` that
/// no save can need: those of `replaced` (the generation the marker named before our commit:
/// replaced, it is never committed again), and, unless in flight in this process or named by
/// the marker now, those this process's saves wrote and those older than stale_after.
/// The directory is listed before the in-flight set is read and the marker last, so a save
/// that commits meanwhile is either seen in flight or named by the marker. Failures to remove
/// are ignored: the commit stands.
inline void remove_stale(const std::filesystem::path& path, const save_id& ours,
                         std::optional<std::uint64_t> replaced) {
    namespace fs = std::filesystem;
    std::error_code ec;
    fs::path dir = path.parent_path();
    if (dir.empty())
        dir = ".";
    const std::string base = path.filename().string();
    std::vector<std::pair<fs::path, save_file>> found;
    for (auto it = fs::directory_iterator(dir, ec); !ec && it != fs::directory_iterator();
         it.increment(ec)) {
        const std::string name = it->path().filename().string();
        if (auto f = parse_save_file(name, base))
            found.emplace_back(it->path(), std::move(*f));
    }
    std::multiset<std::uint64_t> inflight;
    {
        std::lock_guard lock(inflight_saves::get().mutex);
        inflight = inflight_saves::get().gens;
    }
    const std::uint64_t keep = committed_generation(path).value_or(ours.gen);
    const save_owner me = this_process();
    const auto now = fs::file_time_type::clock::now();
    for (const auto& [p, f] : found) {
        // Our own generation is in flight until we return: replaced, it goes now.
        const bool ours_replaced = f.gen && *f.gen == ours.gen && keep != ours.gen;
        if (f.gen && !ours_replaced && (*f.gen == keep || inflight.count(*f.gen) != 0))
            continue;
        bool doomed = ours_replaced || (f.gen && replaced && *f.gen == *replaced) ||
                      (f.owner && *f.owner == me);
        if (!doomed) {
            const auto t = fs::last_write_time(p, ec);
            doomed = !ec && now - t > stale_after;
        }
        if (doomed)
            fs::remove(p, ec);
    }
}

} // namespace lockstep::detail::ckpt
