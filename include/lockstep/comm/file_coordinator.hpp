// lockstep/comm/file_coordinator.hpp: survivor_agreement, how the survivors of a group that lost
// a member across processes take one decision on who continues, and file_coordinator, that
// decision through a directory every process sees. SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/timeout.hpp"
#include "lockstep/core/error.hpp"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <memory>
#include <span>
#include <sstream>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include <unistd.h>

namespace lockstep {

/// How the survivors of a group that lost a member across processes agree (nccl_options::
/// survivors, nccl_communicator::shrink): a type-erased object with two collective calls over
/// the members still alive. `decide(generation, member, members, timeout)` (operator()), called
/// with the caller's member id and the generation's members (ids in ascending order), returns
/// the members that continue, in ascending order: the same list on every caller, whatever the
/// order and timing of the calls. A caller missing from the list was left out (it arrived too
/// late): it must not join the next generation. `timeout` bounds how long a caller waits for
/// members that may never come. `share(generation, member, survivors, timeout, make)`, called by
/// every member of that decision, returns the bytes the first survivor (survivors.front()) got
/// from its own `make()`, the same on every caller (the NCCL id the survivors' communicator is
/// made from); a caller waits at most `timeout` for them. file_coordinator is one.
class survivor_agreement {
public:
    using make_fn = std::function<std::vector<std::byte>()>;

    survivor_agreement() = default;
    /// Any object with both calls (file_coordinator); held by a shared pointer, so copies of the
    /// agreement share it.
    template <class C>
    requires requires(const C& c, std::span<const int> m, const make_fn& f) {
        {
            c(std::uint64_t{}, 0, m, std::chrono::milliseconds{})
            } -> std::convertible_to<std::vector<int>>;
        {
            c.share(std::uint64_t{}, 0, m, std::chrono::milliseconds{}, f)
            } -> std::convertible_to<std::vector<std::byte>>;
    }
    survivor_agreement(C c) // NOLINT(google-explicit-constructor): assigned as an option
        : impl_(std::make_shared<model<C>>(std::move(c))) {}

    explicit operator bool() const noexcept { return impl_ != nullptr; }

    std::vector<int> operator()(std::uint64_t generation, int member, std::span<const int> members,
                                std::chrono::milliseconds timeout) const {
        return impl_->decide(generation, member, members, timeout);
    }
    std::vector<std::byte> share(std::uint64_t generation, int member,
                                 std::span<const int> survivors, std::chrono::milliseconds timeout,
                                 const make_fn& make) const {
        return impl_->share(generation, member, survivors, timeout, make);
    }

private:
    struct concept_t {
        virtual ~concept_t() = default;
        virtual std::vector<int> decide(std::uint64_t, int, std::span<const int>,
                                        std::chrono::milliseconds) const = 0;
        virtual std::vector<std::byte> share(std::uint64_t, int, std::span<const int>,
                                             std::chrono::milliseconds, const make_fn&) const = 0;
    };
    template <class C>
    struct model final : concept_t {
        explicit model(C c) : c_(std::move(c)) {}
        std::vector<int> decide(std::uint64_t g, int m, std::span<const int> ms,
                                std::chrono::milliseconds t) const override {
            return c_(g, m, ms, t);
        }
        std::vector<std::byte> share(std::uint64_t g, int m, std::span<const int> s,
                                     std::chrono::milliseconds t, const make_fn& f) const override {
            return c_.share(g, m, s, t, f);
        }
        C c_;
    };
    std::shared_ptr<const concept_t> impl_;
};

/// A survivor_agreement through a directory that every process of the job sees (a local one for
/// one machine, a shared file system across machines: it needs link() to fail atomically on an
/// existing name, as local file systems and NFS do). Generation g's call marks its member
/// arrived (file `g<g>.arrived.<member>`) and waits until every member arrived or `timeout`
/// passed since its call; the first caller to get there publishes the members that arrived as
/// the decision (`g<g>.decision`, written to a temporary name and linked, so it appears whole
/// and only once), and every caller returns that decision. A member that arrives after it sees
/// itself left out. `share` of generation g: the first survivor writes its bytes to
/// `g<g>.shared` (under another name, then linked), the others wait for that file. One
/// directory per job and communicator: the constructor refuses one holding
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
        const auto deadline = deadline_after(timeout);
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
                std::string text;
                for (int m : arrived)
                    text += std::to_string(m) + '\n';
                publish(decision, g + ".proposal", std::as_bytes(std::span(text)), member);
                return read(decision, members, member);
            }
            std::this_thread::sleep_for(std::chrono::milliseconds(2));
        }
    }

    /// survivor_agreement::share. requires: `member` in `survivors` (the decision), timeout > 0.
    /// Throws errc::timeout when the first survivor's bytes do not come within `timeout` (it was
    /// lost after the decision).
    std::vector<std::byte> share(std::uint64_t generation, int member,
                                 std::span<const int> survivors, std::chrono::milliseconds timeout,
                                 const survivor_agreement::make_fn& make) const {
        const std::string op = "file_coordinator.share";
        LOCKSTEP_REQUIRE(std::binary_search(survivors.begin(), survivors.end(), member),
                         errc::invalid_argument, member, op, "member ", member,
                         " is not one of the survivors");
        const std::string g = "g" + std::to_string(generation);
        const std::filesystem::path shared = dir_ / (g + ".shared");
        if (member == survivors.front()) {
            std::vector<std::byte> bytes = make();
            publish(shared, g + ".sharing", bytes, member);
            return bytes;
        }
        const auto deadline = deadline_after(timeout);
        for (std::error_code ec; !std::filesystem::exists(shared, ec);) {
            LOCKSTEP_REQUIRE(std::chrono::steady_clock::now() < deadline, errc::timeout, member, op,
                             "the first survivor (member ", survivors.front(),
                             ") did not share its bytes of generation ", generation, " within ",
                             timeout.count(), " ms: it was lost after the decision");
            std::this_thread::sleep_for(std::chrono::milliseconds(2));
        }
        std::ifstream f(shared, std::ios::binary);
        const std::string text((std::istreambuf_iterator<char>(f)),
                               std::istreambuf_iterator<char>());
        std::vector<std::byte> out(text.size());
        std::memcpy(out.data(), text.data(), text.size());
        return out;
    }

private:
    void touch(const std::string& name, int member) const {
        std::ofstream f(dir_ / name);
        LOCKSTEP_REQUIRE(static_cast<bool>(f), errc::communication, member, "file_coordinator",
                         "cannot create ", (dir_ / name).string());
    }

    /// Writes `bytes` to `proposal`, then links it to `decision` unless another caller's is
    /// there already (link fails with EEXIST: that one stands).
    void publish(const std::filesystem::path& decision, const std::string& proposal,
                 std::span<const std::byte> bytes, int member) const {
        const std::filesystem::path tmp = dir_ / (proposal + "." + std::to_string(member));
        {
            std::ofstream f(tmp, std::ios::trunc | std::ios::binary);
            f.write(reinterpret_cast<const char*>(bytes.data()), // NOLINT: bytes as chars
                    static_cast<std::streamsize>(bytes.size()));
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
