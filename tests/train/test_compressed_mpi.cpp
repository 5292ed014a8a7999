// compressed_all_reduce over MPI (one replica per process): every rank gets the bits of a scalar
// emulation (each contribution rounded to the wire type, float sum in rank order, the sum
// rounded), for sizes below the rank count, odd sizes and several chunks.
// SPDX-License-Identifier: Apache-2.0
#include <catch2/catch.hpp>

#include "support/mpi_session.hpp"

#include "lockstep/comm/mpi_communicator.hpp"
#include "lockstep/train/detail/compressed_all_reduce.hpp"

#include <cmath>
#include <cstring>
#include <span>
#include <vector>

using namespace lockstep;

namespace {

// Rank r's element i: different on every rank, spread over 23 binades.
double input(int r, std::size_t i) {
    return std::sin(0.731 * double(i) + 1.9 * r) * std::ldexp(1.0, int(i % 23) - 12) *
           (1 + 0.1 * r);
}

template <class Wire, class T>
void check(mpi_communicator& comm, std::size_t n, std::size_t chunk) {
    INFO("n " << n << ", chunk " << chunk << ", " << comm.size() << " ranks");
    std::vector<T> g(n);
    for (std::size_t i = 0; i < n; ++i)
        g[i] = static_cast<T>(input(comm.rank(), i));
    detail::compressed_workspace<T, host_system> ws(comm.system(), comm.size(), n, chunk);
    CHECK(detail::compressed_all_reduce<Wire>(comm, std::span<T>(g), ws) ==
          2 * ((n + chunk - 1) / chunk));
    std::size_t wrong = 0;
    for (std::size_t i = 0; i < n; ++i) {
        float acc = float(Wire(static_cast<float>(static_cast<T>(input(0, i)))));
        for (int r = 1; r < comm.size(); ++r)
            acc += float(Wire(static_cast<float>(static_cast<T>(input(r, i)))));
        wrong += static_cast<float>(g[i]) != float(Wire(acc));
    }
    CHECK(wrong == 0);
    // The same bits on every rank.
    std::vector<T> all(n * static_cast<std::size_t>(comm.size()));
    comm.all_gather(std::span<const T>(g), std::span<T>(all));
    for (int r = 1; r < comm.size(); ++r)
        CHECK(std::memcmp(all.data() + static_cast<std::size_t>(r) * n, g.data(), n * sizeof(T)) ==
              0);
}

} // namespace

TEST_CASE("compressed_all_reduce over MPI equals the scalar emulation on every rank",
          "[train][mpi][compressed]") {
    mpi_communicator comm(MPI_COMM_WORLD);
    for (const std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{2}, std::size_t{5},
                                std::size_t{4099}, std::size_t{100003}}) {
        check<lockstep::half, float>(comm, n, detail::compressed_chunk_elements<mpi_communicator>);
        check<lockstep::bfloat16, float>(comm, n, 1000);
        check<lockstep::half, double>(comm, n, 30001);
    }
}

int main(int argc, char** argv) {
    return lockstep::testing::run_mpi_session(argc, argv);
}
