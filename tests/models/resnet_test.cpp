#include <gtest/gtest.h>
#include <torch/torch.h>

#include "test_util.h"

#include "framefit/models/resnet.h"
#include "framefit/models/weights.h"

using namespace framefit::models;

using framefit::test_util::has_key;

TEST(ResNet, FeatureAndLogitShapes) {
  torch::NoGradGuard no_grad;
  const auto x = torch::randn({2, 3, 64, 64});
  for (auto [depth, dim] : {std::pair{18, 512}, {34, 512}, {50, 2048}}) {
    ResNet classifier(ResNetOptions(depth).num_classes(7));
    classifier->eval();
    EXPECT_EQ(classifier->forward(x).sizes(), (std::vector<int64_t>{2, 7})) << depth;
    EXPECT_EQ(classifier->feature_dim(), dim);
    ResNet encoder(ResNetOptions(depth).num_classes(0));
    encoder->eval();
    EXPECT_EQ(encoder->forward(x).sizes(), (std::vector<int64_t>{2, dim})) << depth;
  }
  ResNet slim(ResNetOptions(50).num_classes(0).drop_layer4(true));
  slim->eval();
  EXPECT_EQ(slim->feature_dim(), 1024);
  EXPECT_EQ(slim->forward(torch::randn({1, 3, 32, 32})).size(1), 1024);
  EXPECT_FALSE(has_key(state_dict(*slim), "layer4.0.conv1.weight"));
}

TEST(ResNet, TorchvisionNames) {
  const auto r50 = state_dict(*ResNet(ResNetOptions(50)));
  for (const char* name : {"conv1.weight", "bn1.running_var", "bn1.num_batches_tracked",
                           "layer1.0.conv3.weight", "layer1.0.downsample.0.weight",
                           "layer1.0.downsample.1.running_mean", "layer4.2.bn3.bias",
                           "fc.weight", "fc.bias"}) {
    EXPECT_TRUE(has_key(r50, name)) << name;
  }
  EXPECT_FALSE(has_key(r50, "conv1.bias"));
  EXPECT_EQ(r50.size(), 320u);  // torchvision's resnet50().state_dict() has 320 entries
  const auto r18 = state_dict(*ResNet(ResNetOptions(18)));
  EXPECT_EQ(r18.size(), 122u);
  EXPECT_FALSE(has_key(r18, "layer1.0.downsample.0.weight"));
  EXPECT_TRUE(has_key(r18, "layer2.0.downsample.0.weight"));
  EXPECT_FALSE(has_key(state_dict(*ResNet(ResNetOptions(18).num_classes(0))), "fc.weight"));
}

TEST(ResNet, FreezeStagesKeepsStatisticsAndGradientsOff) {
  ResNet net(ResNetOptions(18).num_classes(0).freeze("layer2"));
  net->train();
  for (const auto& p : net->named_parameters()) {
    const bool frozen = p.key().rfind("conv1", 0) == 0 || p.key().rfind("bn1", 0) == 0 ||
                        p.key().rfind("layer1", 0) == 0 || p.key().rfind("layer2", 0) == 0;
    EXPECT_EQ(p.value().requires_grad(), !frozen) << p.key();
  }
  const auto frozen_mean = net->layer2[0]->as<ResidualBlock>()->bn1->running_mean.clone();
  const auto trained_mean = net->layer3[0]->as<ResidualBlock>()->bn1->running_mean.clone();
  net->forward(torch::randn({2, 3, 64, 64})).sum().backward();
  EXPECT_TRUE(torch::equal(frozen_mean, net->layer2[0]->as<ResidualBlock>()->bn1->running_mean));
  EXPECT_FALSE(torch::equal(trained_mean, net->layer3[0]->as<ResidualBlock>()->bn1->running_mean));
  EXPECT_FALSE(net->layer1[0]->as<ResidualBlock>()->conv1->weight.grad().defined());
  EXPECT_TRUE(net->layer3[0]->as<ResidualBlock>()->conv1->weight.grad().defined());
  EXPECT_NE(framefit::test_util::error_message([] { ResNet(ResNetOptions(18).freeze("layer9")); }).find("stages are"),
            std::string::npos);
}

TEST(ResNet, NormKinds) {
  ResNet gn(ResNetOptions(18).num_classes(0).norm(NormKind::GroupNorm).groups(32));
  const auto state = state_dict(*gn);
  EXPECT_TRUE(has_key(state, "bn1.weight"));
  EXPECT_FALSE(has_key(state, "bn1.running_mean"));
  // GroupNorm makes every frame independent of the others in its batch.
  gn->train();
  const auto x = torch::randn({4, 3, 32, 32});
  EXPECT_TRUE(torch::allclose(gn->forward(x).slice(0, 0, 2), gn->forward(x.slice(0, 0, 2)),
                              1e-4, 1e-5));
  EXPECT_NE(framefit::test_util::error_message([] { ResNet(ResNetOptions(18).norm(NormKind::GroupNorm).groups(7)); })
                .find("cannot split"),
            std::string::npos);

  ResNet frozen(ResNetOptions(18).num_classes(0).norm(NormKind::FrozenBatchNorm));
  frozen->train();
  for (const auto& p : frozen->named_parameters()) {
    if (p.key().find("bn") != std::string::npos) EXPECT_FALSE(p.value().requires_grad()) << p.key();
  }
  const auto before = frozen->bn1->running_mean.clone();
  frozen->forward(x);
  EXPECT_TRUE(torch::equal(before, frozen->bn1->running_mean));
  EXPECT_EQ(parse_norm_kind("frozen_bn"), NormKind::FrozenBatchNorm);
  EXPECT_THROW(parse_norm_kind("layer_norm"), c10::Error);
}

TEST(ResNet, BatchNormCountsBatchesInTraining) {
  ResNet net(ResNetOptions(18).num_classes(0));
  net->train();
  net->forward(torch::randn({2, 3, 32, 32}));
  net->forward(torch::randn({2, 3, 32, 32}));
  EXPECT_EQ(net->bn1->num_batches_tracked.item<int64_t>(), 2);
  net->eval();
  net->forward(torch::randn({2, 3, 32, 32}));
  EXPECT_EQ(net->bn1->num_batches_tracked.item<int64_t>(), 2);
}

TEST(ResNet, ChannelsLastGivesTheSameOutput) {
  torch::NoGradGuard no_grad;
  ResNet plain(ResNetOptions(18).num_classes(5));
  ResNet nhwc(ResNetOptions(18).num_classes(5).channels_last(true));
  load_state_dict(*nhwc, state_dict(*plain));
  plain->eval();
  nhwc->eval();
  const auto x = torch::randn({2, 3, 64, 64});
  EXPECT_TRUE(nhwc->conv1->weight.is_contiguous(torch::MemoryFormat::ChannelsLast));
  EXPECT_TRUE(torch::allclose(plain->forward(x), nhwc->forward(x), 1e-4, 1e-4));
}

TEST(ResNet, MixedLayoutGivesTheSameOutputAndGradients) {
  ResNet plain(ResNetOptions(18).num_classes(5));
  ResNet mixed(ResNetOptions(18).num_classes(5).channels_last(true).nchw_from("layer4"));
  load_state_dict(*mixed, state_dict(*plain));
  EXPECT_TRUE(mixed->layer3->parameters()[0].is_contiguous(torch::MemoryFormat::ChannelsLast));
  EXPECT_FALSE(mixed->layer4->parameters()[0].is_contiguous(torch::MemoryFormat::ChannelsLast));
  // float64: the layouts sum in different orders, which float32 BatchNorm gradients magnify.
  plain->to(torch::kFloat64);
  mixed->to(torch::kFloat64);
  EXPECT_TRUE(mixed->layer3->parameters()[0].is_contiguous(torch::MemoryFormat::ChannelsLast));
  const auto x = torch::randn({4, 3, 64, 64}, torch::kFloat64);
  const auto layer4_input = mixed->forward_stages(x, 0, 4);
  EXPECT_TRUE(layer4_input.is_contiguous(torch::MemoryFormat::ChannelsLast));
  plain->forward(x).square().sum().backward();
  mixed->forward(x).square().sum().backward();
  const auto mixed_parameters = mixed->named_parameters();
  for (const auto& item : plain->named_parameters()) {
    const auto& q = mixed_parameters[item.key()];
    EXPECT_TRUE(torch::allclose(item.value().grad(), q.grad(), 1e-9, 1e-10)) << item.key();
  }
}

TEST(ResNet, NchwFromMustNameAStage) {
  EXPECT_THROW(ResNet(ResNetOptions(18).channels_last(true).nchw_from("layer5")), c10::Error);
  // The auto layout names layer4 whether or not it is dropped.
  ResNet slim(ResNetOptions(18).channels_last(true).nchw_from("layer4").drop_layer4(true));
  EXPECT_TRUE(slim->layer3->parameters()[0].is_contiguous(torch::MemoryFormat::ChannelsLast));
}

TEST(ResNet, AutoLayoutIsChannelsLastWithBatchNormAndLayer4NchwOnTheCpu) {
  const auto cpu = c10::DeviceType::CPU;
  const auto cuda = c10::DeviceType::CUDA;
  auto resolved = [](ActivationLayout layout, NormKind norm, c10::DeviceType device) {
    const auto r = resolve_layout(layout, norm, device);
    return std::string(r.channels_last ? "nhwc" : "nchw") + "/" + r.nchw_from;
  };
  EXPECT_EQ(resolved(ActivationLayout::Auto, NormKind::BatchNorm, cpu), "nhwc/layer4");
  EXPECT_EQ(resolved(ActivationLayout::Auto, NormKind::FrozenBatchNorm, cpu), "nhwc/layer4");
  EXPECT_EQ(resolved(ActivationLayout::Auto, NormKind::BatchNorm, cuda), "nhwc/");
  EXPECT_EQ(resolved(ActivationLayout::Auto, NormKind::GroupNorm, cpu), "nchw/");
  EXPECT_EQ(resolved(ActivationLayout::ChannelsLast, NormKind::GroupNorm, cpu), "nhwc/");
  EXPECT_EQ(resolved(ActivationLayout::Nchw, NormKind::BatchNorm, cuda), "nchw/");
  EXPECT_EQ(parse_activation_layout("channels_last"), ActivationLayout::ChannelsLast);
  EXPECT_THROW(parse_activation_layout("nhwc"), c10::Error);
}

TEST(ResNet, BadInputIsExplained) {
  ResNet net(ResNetOptions(18));
  net->eval();
  EXPECT_NE(framefit::test_util::error_message([&] { net->forward(torch::randn({3, 64, 64})); }).find("[N,3,H,W]"),
            std::string::npos);
  EXPECT_NE(framefit::test_util::error_message([&] { net->forward(torch::randn({1, 64, 64, 3})); }).find("permute"),
            std::string::npos);
  EXPECT_NE(framefit::test_util::error_message([&] { net->forward(torch::zeros({1, 3, 64, 64}, torch::kUInt8)); })
                .find("frames_to_input"),
            std::string::npos);
  EXPECT_NE(framefit::test_util::error_message([&] { net->forward(torch::randn({1, 3, 16, 64})); }).find("at least 32"),
            std::string::npos);
  EXPECT_THROW(ResNet(ResNetOptions(101)), c10::Error);
  EXPECT_EQ(parse_resnet_name("resnet34"), 34);
  EXPECT_THROW(parse_resnet_name("vgg16"), c10::Error);
}
