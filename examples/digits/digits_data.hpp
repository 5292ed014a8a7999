// examples/digits/digits_data.hpp: loads the 8x8 digits CSV (gzipped or plain), scales pixels to
// [0, 1] and splits train/test deterministically. SPDX-License-Identifier: Apache-2.0
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include <zlib.h>

namespace digits {

inline constexpr int features = 64; ///< 8x8 pixels
inline constexpr int classes = 10;  ///< digits 0..9

/// Samples in row-major order: x[i * features + f] in [0, 1], y[i] in 0..9.
struct dataset {
    std::vector<float> x;
    std::vector<int> y;
    std::size_t size() const noexcept { return y.size(); }
};

/// The train and test parts of the data.
struct split_data {
    dataset train, test;
};

/// Reads `path` (gzip or plain CSV: 64 pixel values 0..16, then the label, per line) and splits
/// it: sample i goes to the test set iff i % 5 == 4 (20 %; the file cycles through the classes,
/// so both parts hold every class in about equal numbers). Pixels are divided by 16.
/// Throws std::runtime_error naming the file and line on unreadable or malformed input.
inline split_data load(const std::string& path) {
    gzFile f = gzopen(path.c_str(), "rb"); // gzread passes non-gzip files through unchanged
    if (f == nullptr)
        throw std::runtime_error("digits: cannot open " + path);
    std::string text;
    char chunk[1 << 16];
    for (;;) {
        const int n = gzread(f, chunk, sizeof(chunk));
        if (n < 0) {
            int code = 0;
            const std::string msg = gzerror(f, &code);
            gzclose(f);
            throw std::runtime_error("digits: reading " + path + " failed: " + msg);
        }
        if (n == 0)
            break;
        text.append(chunk, static_cast<std::size_t>(n));
    }
    gzclose(f);

    split_data out;
    std::size_t pos = 0, line = 0, sample = 0;
    while (pos < text.size()) {
        const std::size_t eol = std::min(text.find('\n', pos), text.size());
        ++line;
        if (eol == pos || (eol == pos + 1 && text[pos] == '\r')) {
            pos = eol + 1;
            continue;
        }
        int values[features + 1];
        int count = 0;
        std::size_t i = pos;
        while (i < eol && count <= features) {
            int v = 0, digits_read = 0;
            while (i < eol && text[i] >= '0' && text[i] <= '9') {
                v = v * 10 + (text[i] - '0');
                ++i;
                ++digits_read;
            }
            if (digits_read == 0)
                break;
            values[count++] = v;
            if (i < eol && text[i] == ',')
                ++i;
        }
        while (i < eol && (text[i] == '\r' || text[i] == ' '))
            ++i;
        if (count != features + 1 || i != eol || values[features] >= classes)
            throw std::runtime_error("digits: " + path + ":" + std::to_string(line) +
                                     ": expected 64 pixel values and a label 0..9");
        dataset& d = (sample % 5 == 4) ? out.test : out.train;
        for (int k = 0; k < features; ++k) {
            if (values[k] > 16)
                throw std::runtime_error("digits: " + path + ":" + std::to_string(line) +
                                         ": pixel value " + std::to_string(values[k]) +
                                         " outside 0..16");
            d.x.push_back(static_cast<float>(values[k]) / 16.0f);
        }
        d.y.push_back(values[features]);
        ++sample;
        pos = eol + 1;
    }
    if (out.train.size() == 0 || out.test.size() == 0)
        throw std::runtime_error("digits: " + path + " holds too few samples");
    return out;
}

} // namespace digits
