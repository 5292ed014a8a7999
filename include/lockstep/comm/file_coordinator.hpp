// lockstep/comm/file_coordinator.hpp: survivor_agreement, how the survivors of a group that lost
// a member across processes take one decision on who continues, and file_coordinator, that
// decision through a directory every process sees. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/core/error.hpp"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <span>
#include <sstream>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include <unistd.h>

namespace lockstep {

/// The survivors' one decision (nccl_communicator::shrink, nccl_options::survivors): called by
/// every member of generation `generation` that is still alive, with its own member id and the
/// generation's members (ids in ascending order), it returns the members that continue, in
/// ascending order: the same list on every caller, whatever the order and timing of the calls.
/// A caller missing from the list was left out (it arrived too late): it must not join the next
/// generation. `timeout` bounds how long a caller waits for members that may never come.
using survivor_agreement = std::function<std::vector<int>(std::uint64_t generation, int member,
                                                          std::span<const int> members,
                                                          std::chrono::milliseconds timeout)>;

/// A survivor_agreement through a directory that every process of the job sees (a local one for
/// one machine, a shared file system across machines: it needs link() to fail atomically on an
/// existing name, as local file systems and NFS do). Generation g's call marks its member
/// arrived (file `g<g>.arrived.<member>`) and waits until every member arrived or `timeout`
/// passed since its call; the first caller to get there publishes the members that arrived as
/// the decision (`g<g>.decision`, written to a temporary name and linked, so it appears whole
/// and only once), and every caller returns that decision. A member that arrives after it sees
/// itself left out. One directory per job and communicator: the constructor refuses one holding
/// an earlier run's decisions (they would be taken for this run's), but cannot tell an earlier
/// run's arrival marks from this run's (a member wrongly counted as arrived makes the survivors'
/// shrink wait for it and fail with errc::timeout). On NFS, mount
/// with lookupcache=positive (or none), or a new file may stay unseen for seconds.
class file_coordinator {
public:
    /// Creates `dir` when missing. Throws lockstep::error: errc::communication when it cannot be
    /// created, errc::invalid_argument when it holds an earlier run's decisions.
    explicit file_coordinator(std::filesystem::path dir) : dir_(std::move(dir)) {
        std::error_code ec;
        std::filesystem::create_directories(dir_, ec); // another process may make it meanwhile
        LOCKSTEP_REQUIRE(std::filesystem::is_directory(dir_), errc::communication, -1,
                         "file_coordinator", "cannot create the directory ", dir_.string(), ": ",
                         ec.message());
        for (const auto& e : std::filesystem::directory_iterator(dir_)) {
            const std::string name = e.path().filename().string();
            // (Not the arrival marks: a process of this run may have arrived already.)
            const bool decided =
                name.rfind('g', 0) == 0 && name.find(".decision") != std::string::npos;
            LOCKSTEP_REQUIRE(!decided, errc::invalid_argument, -1, "file_coordinator",
                             "the directory ", dir_.string(), " holds ", name,
                             " from an earlier run; give every job and communicator a directory "
                             "of its own");
        }
    }

    const std::filesystem::path& directory() const noexcept { return dir_; }

    /// survivor_agreement. requires: `member` in `members` (ascending, distinct), timeout > 0.
    std::vector<int> operator()(std::uint64_t generation, int member, std::span<const int> members,
                                std::chrono::milliseconds timeout) const {
        const std::string op = "file_coordinator";
        LOCKSTEP_REQUIRE(std::is_sorted(members.begin(), members.end()) &&
                             std::adjacent_find(members.begin(), members.end()) == members.end() &&
                             std::binary_search(members.begin(), members.end(), member),
                         errc::invalid_argument, member, op, "member ", member,
                         " is not one of the generation's members (ascending, distinct)");
        LOCKSTEP_REQUIRE(timeout.count() > 0, errc::invalid_argument, member, op,
                         "timeout = 0: the survivors need a deadline to leave a lost member out");
        const std::string g = "g" + std::to_string(generation);
        touch(g + ".arrived." + std::to_string(member), member);
        const auto deadline = std::chrono::steady_clock::now() + timeout;
        const std::filesystem::path decision = dir_ / (g + ".decision");
        for (;;) {
            std::error_code ec;
            if (std::filesystem::exists(decision, ec))
                return read(decision, members, member);
            std::vector<int> arrived;
            for (int m : members)
                if (std::filesystem::exists(dir_ / (g + ".arrived." + std::to_string(m)), ec))
                    arrived.push_back(m);
            if (arrived.size() == members.size() || std::chrono::steady_clock::now() >= deadline) {
                publish(decision, g + ".proposal." + std::to_string(member), arrived, member);
                return read(decision, members, member);
            }
            std::this_thread::sleep_for(std::chrono::milliseconds(2));
        }
    }

private:
    void touch(const std::string& name, int member) const {
        std::ofstream f(dir_ / name);
        LOCKSTEP_REQUIRE(static_cast<bool>(f), errc::communication, member, "file_coordinator",
                         "cannot create ", (dir_ / name).string());
    }

    /// Writes `arrived` to `proposal`, then links it to `decision` unless another caller's is
    /// there already (link fails with EEXIST: that one stands).
    void publish(const std::filesystem::path& decision, const std::string& proposal,
                 const std::vector<int>& arrived, int member) const {
        const std::filesystem::path tmp = dir_ / proposal;
        {
            std::ofstream f(tmp, std::ios::trunc);
            for (int m : arrived)
                f << m << '\n';
            f.flush();
            LOCKSTEP_REQUIRE(static_cast<bool>(f), errc::communication, member, "file_coordinator",
                             "cannot write ", tmp.string());
        }
        const int r = ::link(tmp.c_str(), decision.c_str());
        const int err = errno;
        std::error_code ec;
        std::filesystem::remove(tmp, ec);
        LOCKSTEP_REQUIRE(r == 0 || err == EEXIST, errc::communication, member, "file_coordinator",
                         "cannot publish ", decision.string(), ": ", std::strerror(err));
    }

    /// The published decision, checked: ascending members of the generation.
    static std::vector<int> read(const std::filesystem::path& decision,
                                 std::span<const int> members, int member) {
        std::ifstream f(decision);
        std::stringstream text;
        text << f.rdbuf();
        std::vector<int> out;
        for (int m = 0; text >> m;)
            out.push_back(m);
        const bool ok = std::is_sorted(out.begin(), out.end()) &&
                        std::all_of(out.begin(), out.end(), [&](int m) {
                            return std::binary_search(members.begin(), members.end(), m);
                        });
        LOCKSTEP_REQUIRE(ok && !out.empty(), errc::internal, member, "file_coordinator",
                         "the decision ", decision.string(),
                         " is not a list of the generation's members (another job's directory?)");
        return out;
    }

    std::filesystem::path dir_;
};

} // namespace lockstep
