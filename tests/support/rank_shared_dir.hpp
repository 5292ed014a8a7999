// tests/support/rank_shared_dir.hpp: shared_dir, a temporary directory every rank of a launch()
// uses: made by rank 0, its path handed to the others through the launcher.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "support/rank_process.hpp"

#include <cstdlib>
#include <filesystem>
#include <span>
#include <stdexcept>
#include <string>
#include <system_error>

namespace lockstep_test::ranks {

/// A directory in the temporary directory, the same on every rank: rank 0 makes it (mkdtemp)
/// and removes it with everything in it when its object goes, so the ranks agree they are done
/// with it (ranks::agree) before that. Collective (share_from_rank0). Throws std::runtime_error
/// when it cannot be made or shared.
class shared_dir {
public:
    /// `name`: the directory's name up to its random suffix.
    explicit shared_dir(const std::string& name) {
        std::string mine;
        if (rank() == 0) {
            std::string pattern =
                (std::filesystem::temp_directory_path() / (name + "_XXXXXX")).string();
            if (::mkdtemp(pattern.data()) == nullptr)
                throw std::runtime_error("shared_dir: mkdtemp failed for " + pattern);
            mine = pattern;
        }
        const auto bytes = share_from_rank0(std::as_bytes(std::span(mine)));
        path_.assign(reinterpret_cast<const char*>(bytes.data()), bytes.size());
        if (path_.empty())
            throw std::runtime_error("shared_dir: rank 0 shared no path");
    }
    shared_dir(const shared_dir&) = delete;
    shared_dir& operator=(const shared_dir&) = delete;
    ~shared_dir() {
        if (rank() == 0) {
            std::error_code ec;
            std::filesystem::remove_all(path_, ec);
        }
    }
    const std::string& path() const noexcept { return path_; }

private:
    std::string path_;
};

} // namespace lockstep_test::ranks
