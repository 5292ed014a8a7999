// examples/digits/digits_default.cpp: the digits_demo program's only policy combination, the
// demo's defaults (--sync sync --reduce bucketed --optim sgd --bn local), for every communicator
// of the build. It stands in for the four family units of the full `digits` target, so
// `bash scripts/demo` compiles one combination instead of every one before its first run.
// SPDX-License-Identifier: Apache-2.0
#include "digits_run.hpp"

#include <lockstep/comm/thread_group.hpp>
#if LOCKSTEP_HAS_MPI
#include <lockstep/comm/mpi_communicator.hpp>
#endif

namespace digits {
namespace {

/// Explains that this build has the default policies only.
bool not_in_this_build(const options& o, std::string& why) {
    why = "this build (digits_demo, what bash scripts/demo runs) has the default policies only "
          "(--sync sync --reduce bucketed --optim sgd --bn local), not --sync " +
          o.sync + " --reduce " + o.reduce + " --optim " + o.optim + " --bn " + o.bn +
          ": build the target digits, which has every combination (bash scripts/demo builds it "
          "when you give --sync, --reduce, --optim or --bn)";
    return false;
}

} // namespace

template <class Comm>
bool run_synchronous_local_bn(Comm& comm, const options& o, const split_data& d, result& r,
                              std::string& why) {
    if (o.sync != "sync" || o.reduce != "bucketed" || o.optim != "sgd" || o.bn != "local")
        return not_in_this_build(o, why);
    r = train_and_evaluate<lockstep::sync::synchronous, lockstep::reduce::bucketed<>,
                           lockstep::optim::sgd<float>, lockstep::bn::local>(comm, o, d);
    return true;
}

template <class Comm>
bool run_synchronous_shared_bn(Comm&, const options& o, const split_data&, result&,
                               std::string& why) {
    return not_in_this_build(o, why);
}

template <class Comm>
bool run_local_sgd(Comm&, const options& o, const split_data&, result&, std::string& why) {
    return not_in_this_build(o, why);
}

template <class Comm>
bool run_asynchronous(Comm&, const options& o, const split_data&, result&, std::string& why) {
    return not_in_this_build(o, why);
}

// A type argument cannot take the parentheses the check asks for.
// NOLINTBEGIN(bugprone-macro-parentheses)
#define DIGITS_DEFAULT_INSTANTIATE(Comm)                                                           \
    template bool run_synchronous_local_bn(Comm&, const options&, const split_data&, result&,      \
                                           std::string&);                                          \
    template bool run_synchronous_shared_bn(Comm&, const options&, const split_data&, result&,     \
                                            std::string&);                                         \
    template bool run_local_sgd(Comm&, const options&, const split_data&, result&, std::string&);  \
    template bool run_asynchronous(Comm&, const options&, const split_data&, result&, std::string&);
// NOLINTEND(bugprone-macro-parentheses)
DIGITS_DEFAULT_INSTANTIATE(lockstep::thread_communicator)
#if DIGITS_WITH_MPI
DIGITS_DEFAULT_INSTANTIATE(lockstep::mpi_communicator)
#endif
#undef DIGITS_DEFAULT_INSTANTIATE

} // namespace digits
