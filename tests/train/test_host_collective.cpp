// host_all_reduce and host_all_gather through a communicator whose memory is not the host's
// (the staged path nccl_communicator takes): every allocation, the pinned staging of the result
// included, comes before the collective is enqueued (cudaMallocHost between an NCCL enqueue and
// its wait can deadlock with another thread's NCCL operation), and the values are right. A
// recording system and communicator log the order on the host. SPDX-License-Identifier:
// Apache-2.0
#include "lockstep/comm/communicator.hpp"
#include "lockstep/system/host_system.hpp"
#include "lockstep/system/staged_read.hpp"
#include "lockstep/train/detail/host_collective.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <new>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include <thrust/system/cpp/execution_policy.h>

using namespace lockstep;

namespace {

/// What happened, in order.
std::vector<std::string> events;

/// Memory the host may not dereference as far as lockstep knows (is_host = false), which is
/// host memory underneath so that the test can emulate the device's side; allocations and
/// uploads are logged.
struct recording_system {
    static constexpr bool is_host = false;
    static constexpr std::size_t alignment = 64;
    auto policy() const { return thrust::cpp::par; }
    void synchronize() const noexcept {}
    void* allocate(std::size_t bytes) const {
        events.emplace_back("allocate");
        return bytes == 0 ? nullptr : ::operator new (bytes, std::align_val_t{alignment});
    }
    void deallocate(void* p, std::size_t) const noexcept {
        if (p != nullptr)
            ::operator delete (p, std::align_val_t{alignment});
    }
    [[maybe_unused]] friend bool operator==(const recording_system&,
                                            const recording_system&) = default;
    friend void copy_bytes(void* dst, const recording_system&, const void* src, const host_system&,
                           std::size_t bytes) {
        events.emplace_back("upload");
        if (bytes != 0)
            std::memmove(dst, src, bytes);
    }
};
static_assert(execution_system<recording_system>);

} // namespace

/// The read back: its staging is logged where it is allocated, the copy where it is enqueued.
template <class T>
class lockstep::staged_read<T, recording_system> {
public:
    static constexpr bool needs_wait = false;
    staged_read(std::size_t n, const recording_system&) : values_(n) {
        events.emplace_back("read staging");
    }
    std::size_t capacity() const noexcept { return values_.size(); }
    void enqueue(std::span<const T> src) {
        events.emplace_back("read");
        std::copy(src.begin(), src.end(), values_.begin());
        size_ = src.size();
    }
    std::span<const T> values() const noexcept { return {values_.data(), size_}; }

private:
    std::vector<T> values_;
    std::size_t size_ = 0;
};

namespace {

/// Rank 0 of 2 whose peer contributes peer(i) = 100 (i + 1) to every collective; logs them.
class recording_communicator {
public:
    using system_type = recording_system;
    recording_system system() const { return {}; }
    int rank() const { return 0; }
    int size() const { return 2; }
    static int peer(std::size_t i) { return 100 * static_cast<int>(i + 1); }

    template <class T>
    void all_reduce(std::span<const T> send, std::span<T> recv, reduce_op op) {
        events.emplace_back("all_reduce");
        REQUIRE(op == reduce_op::sum);
        std::vector<T> out(send.size());
        for (std::size_t i = 0; i < send.size(); ++i)
            out[i] = send[i] + static_cast<T>(peer(i));
        std::copy(out.begin(), out.end(), recv.begin());
    }
    template <class T>
    void all_gather(std::span<const T> send, std::span<T> recv) {
        events.emplace_back("all_gather");
        std::copy(send.begin(), send.end(), recv.begin());
        for (std::size_t i = 0; i < send.size(); ++i)
            recv[send.size() + i] = static_cast<T>(peer(i));
    }
    template <class T>
    void broadcast(std::span<T>, int) {
        unused();
    }
    template <class T>
    void reduce(std::span<const T>, std::span<T>, reduce_op, int) {
        unused();
    }
    template <class T>
    void reduce_scatter(std::span<const T>, std::span<T>, std::span<const std::size_t>, reduce_op) {
        unused();
    }
    template <class T>
    void reduce_scatter(std::span<const T>, std::span<T>, reduce_op) {
        unused();
    }
    void barrier() { unused(); }
    recording_communicator split(int, int) {
        unused();
        return {};
    }

private:
    [[noreturn]] static void unused() {
        throw std::logic_error("recording_communicator: not used by host_all_reduce/gather");
    }
};
static_assert(communicator<recording_communicator>);

} // namespace

TEST_CASE("host_all_reduce through device memory allocates everything before the collective",
          "[train][host_collective]") {
    events.clear();
    recording_communicator comm;
    const std::vector<int> send{1, 2, 3};
    std::vector<int> recv(3, -1);
    detail::host_all_reduce(comm, std::span<const int>(send), std::span<int>(recv), reduce_op::sum);
    CHECK(events ==
          std::vector<std::string>{"allocate", "upload", "read staging", "all_reduce", "read"});
    CHECK(recv == std::vector<int>{101, 202, 303});
}

TEST_CASE("host_all_gather through device memory allocates everything before the collective",
          "[train][host_collective]") {
    events.clear();
    recording_communicator comm;
    const std::vector<int> send{7, 8};
    std::vector<int> recv(4, -1);
    detail::host_all_gather(comm, std::span<const int>(send), std::span<int>(recv));
    CHECK(events == std::vector<std::string>{"allocate", "upload", "allocate", "read staging",
                                             "all_gather", "read"});
    CHECK(recv == std::vector<int>{7, 8, 100, 200});
}
