// examples/digits/digits_sync.cpp: the sync::synchronous runs of the digits demo with --bn local,
// global, group2 and ghost (--bn ghost goes with --reduce reproducible and only with it).
// SPDX-License-Identifier: Apache-2.0
#include "digits_comm.hpp"
#include "digits_run.hpp"

namespace digits {

template <class Comm>
bool run_synchronous_local_bn(Comm& comm, const options& o, const split_data& d, result& r,
                              std::string& why) {
    namespace bn = lockstep::bn;
    return dispatch<lockstep::sync::synchronous, bn::local, bn::global, bn::group<2>,
                    bn::ghost<repro_chunk>>(comm, o, d, r, why, synchronous_valid{});
}

template bool run_synchronous_local_bn(DIGITS_COMMUNICATOR&, const options&, const split_data&,
                                       result&, std::string&);

} // namespace digits
