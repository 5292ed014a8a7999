// bench/resnet50.hpp: ResNet-50's parameter list (torchvision's 161 tensors) and its batch-norm
// layers' shapes, for the benchmarks that reduce or train a network of its shape.
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "lockstep/train/parameter_registry.hpp"

#include <cstddef>
#include <string>
#include <vector>

namespace lockstep::bench_nets {

// torchvision's resnet50 parameters in registration order: conv1, bn1, layer1..4 (bottlenecks
// of conv1x1, bn, conv3x3, bn, conv1x1, bn, plus a downsample conv1x1 + bn in each layer's
// first block), fc. 161 tensors, 25 557 032 floats.
inline std::vector<tensor_info> resnet50_tensors() {
    std::vector<tensor_info> out;
    std::size_t offset = 0;
    auto add = [&](std::string name, std::vector<std::size_t> shape) {
        std::size_t n = 1;
        for (auto e : shape)
            n *= e;
        out.push_back(tensor_info{std::move(name), std::move(shape), offset, n});
        offset += n;
    };
    auto bn = [&](const std::string& name, std::size_t c) {
        add(name + ".weight", {c});
        add(name + ".bias", {c});
    };
    add("conv1.weight", {64, 3, 7, 7});
    bn("bn1", 64);
    std::size_t in = 64;
    const std::size_t blocks[] = {3, 4, 6, 3};
    for (std::size_t l = 0; l < 4; ++l) {
        const std::size_t width = std::size_t{64} << l, outc = width * 4;
        for (std::size_t b = 0; b < blocks[l]; ++b) {
            const std::string p = "layer" + std::to_string(l + 1) + "." + std::to_string(b);
            add(p + ".conv1.weight", {width, in, 1, 1});
            bn(p + ".bn1", width);
            add(p + ".conv2.weight", {width, width, 3, 3});
            bn(p + ".bn2", width);
            add(p + ".conv3.weight", {outc, width, 1, 1});
            bn(p + ".bn3", outc);
            if (b == 0) {
                add(p + ".downsample.0.weight", {outc, in, 1, 1});
                bn(p + ".downsample.1", outc);
            }
            in = outc;
        }
    }
    add("fc.weight", {1000, 2048});
    add("fc.bias", {1000});
    return out;
}

// The output pixels (H x W) of the layer each tensor of resnet50_tensors() belongs to, for a
// 224 x 224 input: a convolution's backward costs ~ its weights x its output pixels (x batch),
// a BN layer's ~ channels x pixels. conv1 runs at 112 x 112, layer1 at 56 x 56; the first block
// of layers 2-4 runs conv1 (and its BN) at the input resolution and halves it in conv2
// (torchvision's ResNet v1.5); the downsample branch outputs the halved resolution; fc: 1.
inline std::vector<std::size_t> resnet50_output_pixels() {
    std::vector<std::size_t> out;
    auto put = [&](std::size_t side, std::size_t tensors) {
        out.insert(out.end(), tensors, side * side);
    };
    put(112, 3); // conv1, bn1.weight, bn1.bias
    const std::size_t blocks[] = {3, 4, 6, 3};
    std::size_t side = 56;
    for (std::size_t l = 0; l < 4; ++l) {
        const std::size_t in_side = side;
        if (l > 0)
            side /= 2;
        for (std::size_t b = 0; b < blocks[l]; ++b) {
            put(b == 0 ? in_side : side, 3); // conv1 + bn1
            put(side, 6);                    // conv2 + bn2, conv3 + bn3
            if (b == 0)
                put(side, 3); // downsample conv + bn
        }
    }
    put(1, 2); // fc.weight, fc.bias
    return out;
}

/// One batch-norm layer of resnet50_bn_layers(): its name (as in resnet50_tensors(), without
/// ".weight"), its channels and the side of its square feature map.
struct bn_layer {
    std::string name;
    std::size_t channels = 0;
    std::size_t side = 0;
};

/// ResNet-50's 53 batch-norm layers in forward order (bn1, then per bottleneck bn1, bn2, bn3 and
/// in each layer's first block the downsample's BN), for a side x side input. Every stride-2
/// step (conv1, the max pool, the first conv2 of layers 2-4 and their downsample) maps a side s
/// to ceil(s / 2), as the convolutions' padding does: 224 gives 112, 56, 28, 14, 7 (the channels
/// and output pixels of resnet50_output_pixels()); 112 gives 56, 28, 14, 7, 4.
/// requires: side >= 1.
inline std::vector<bn_layer> resnet50_bn_layers(std::size_t side = 224) {
    const auto half = [](std::size_t s) { return (s + 1) / 2; };
    std::vector<bn_layer> out;
    side = half(side);
    out.push_back({"bn1", 64, side});
    side = half(side); // the max pool
    const std::size_t blocks[] = {3, 4, 6, 3};
    for (std::size_t l = 0; l < 4; ++l) {
        const std::size_t width = std::size_t{64} << l, in_side = side;
        if (l > 0)
            side = half(side);
        for (std::size_t b = 0; b < blocks[l]; ++b) {
            const std::string p = "layer" + std::to_string(l + 1) + "." + std::to_string(b);
            out.push_back({p + ".bn1", width, b == 0 ? in_side : side});
            out.push_back({p + ".bn2", width, side});
            out.push_back({p + ".bn3", width * 4, side});
            if (b == 0)
                out.push_back({p + ".downsample.1", width * 4, side});
        }
    }
    return out;
}

} // namespace lockstep::bench_nets
