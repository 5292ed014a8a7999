// A message of more than 2^31 bytes that does not fit the receive buffer: the receiver gets
// errc::count_mismatch naming its size in bytes and the message is consumed, so the next one
// arrives intact (the size in bytes does not fit MPI_Get_count's int); a reduce_scatter of more
// than INT_MAX elements. Needs about 6 GB of memory on two ranks. SPDX-License-Identifier:
// Apache-2.0
#include "lockstep/comm/mpi_communicator.hpp"
#include "support/mpi_session.hpp"

#include <catch2/catch.hpp>

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

using lockstep::errc;
using lockstep::mpi_communicator;

TEST_CASE("a message over 2 GiB of the wrong size is reported and discarded", "[mpi]") {
    mpi_communicator comm(MPI_COMM_WORLD,
                          {.on_failure = lockstep::mpi_failure_action::throw_error});
    REQUIRE(comm.size() == 2);
    const std::size_t n = std::size_t(600) << 20; // 629,145,600 floats: 2,516,582,400 bytes
    if (comm.rank() == 0) {
        std::vector<float> big(n, 1.0f);
        comm.send(std::span<const float>(big), 1, 3);
        const std::vector<float> next{2.0f, 3.0f};
        comm.send(std::span<const float>(next), 1, 4);
    } else {
        std::vector<float> one(1);
        errc code = errc::invalid_argument;
        std::string what;
        try {
            comm.recv(std::span<float>(one), 0, 3);
        } catch (const lockstep::error& e) {
            code = e.code();
            what = e.what();
        }
        INFO(what);
        CHECK(code == errc::count_mismatch);
        CHECK_THAT(what, Catch::Contains("holds 629145600 float elements (2516582400 bytes) "
                                         "but the receive buffer holds 1 float elements"));
        std::vector<float> two(2);
        comm.recv(std::span<float>(two), 0, 4);
        CHECK(two == std::vector<float>{2.0f, 3.0f});
    }
    comm.barrier();
}

TEST_CASE("a reduce_scatter of more than INT_MAX elements runs in pieces", "[mpi]") {
    // 2^31 + 2 bytes per rank: more elements than MPI's int count, which the pieces path (every
    // large reduce_scatter of 4- and 8-byte or byte elements) never hands MPI at once. About
    // 3 GiB per rank.
    mpi_communicator comm(MPI_COMM_WORLD,
                          {.on_failure = lockstep::mpi_failure_action::throw_error});
    REQUIRE(comm.size() == 2);
    const std::size_t n = (std::size_t{1} << 31) + 2, half = n / 2;
    std::vector<std::uint8_t> send(n);
    for (std::size_t i = 0; i < n; ++i) // the ranks' values sum to 1 + (i % 3 == 0)
        send[i] = static_cast<std::uint8_t>(comm.rank() == 0 ? (i + 1) % 2 + (i % 3 == 0) : i % 2);
    std::vector<std::uint8_t> recv(half);
    comm.reduce_scatter(std::span<const std::uint8_t>(send), std::span<std::uint8_t>(recv),
                        lockstep::reduce_op::sum);
    std::size_t wrong = 0;
    const std::size_t first = static_cast<std::size_t>(comm.rank()) * half;
    for (std::size_t k = 0; k < half; ++k)
        wrong += recv[k] != 1 + ((first + k) % 3 == 0) ? 1 : 0;
    CHECK(wrong == 0);
    comm.barrier();
}

int main(int argc, char** argv) {
    return lockstep::testing::run_mpi_session(argc, argv);
}
