// tests/support/replica_errors.hpp: errors_of, each thread replica's error from one run.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/comm/thread_group.hpp"
#include "lockstep/core/error.hpp"

#include <chrono>
#include <cstddef>
#include <string>
#include <utility>
#include <vector>

namespace lockstep_test {

/// Runs fn(rank, comm) on `replicas` thread replicas (30 s timeout) and returns each replica's
/// error text ("" when none) and code (-1). A replica rethrows what it caught, so its peers are
/// told of the failure (not of its communicator's departure); run()'s rethrow of it is dropped.
template <class Fn>
std::vector<std::pair<std::string, int>> errors_of(int replicas, Fn&& fn) {
    std::vector<std::pair<std::string, int>> out(static_cast<std::size_t>(replicas),
                                                 {std::string(), -1});
    try {
        lockstep::thread_group(replicas, {.timeout = std::chrono::seconds(30)})
            .run([&](lockstep::thread_communicator& comm) {
                try {
                    fn(comm.rank(), comm);
                } catch (const lockstep::error& e) {
                    out[static_cast<std::size_t>(comm.rank())] = {e.what(),
                                                                  static_cast<int>(e.code())};
                    throw;
                }
            });
    } catch (const lockstep::error&) {
    }
    return out;
}

/// The error texts of errors_of's result, replica by replica ("" when none).
inline std::vector<std::string> texts_of(const std::vector<std::pair<std::string, int>>& errors) {
    std::vector<std::string> out;
    out.reserve(errors.size());
    for (const auto& [text, code] : errors)
        out.push_back(text);
    return out;
}

} // namespace lockstep_test
