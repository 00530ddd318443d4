"""Image commands: ``qkv classify-image``, ``qkv zero-shot`` and the parsers of ``qkv train vit|swin|clip``."""

from __future__ import annotations

import argparse
import logging
import sys

from .common import (
    add_device_arguments,
    add_force_argument,
    add_ingredient_arguments,
    add_size_arguments,
    add_training_arguments,
    check_new_file,
    command,
    place,
    runtime,
    show_defaults,
)
from .numbers import COUNT, FRACTION, PROBABILITY, integer

log = logging.getLogger("qkv")

DATA_HELP = ("fashion-mnist (apt-get install dataset-fashion-mnist puts it in /usr/share/datasets/fashion-mnist), "
             "digits (scikit-learn's 8x8), a folder of Fashion-MNIST's IDX files (train-images-idx3-ubyte.gz, ...: "
             "Zalando's, read as Fashion-MNIST), or a folder with one subfolder of PNG/JPEG images per class")


# --- qkv train vit / swin / clip (the recipes: qkv.recipes.image_classifier, qkv.recipes.clip) ------------------

def _add_data_arguments(p: argparse.ArgumentParser) -> None:
    data = p.add_argument_group("data")
    data.add_argument("--data", help=f"training images: {DATA_HELP}")
    data.add_argument("--test-data", metavar="DIR", help="a folder's test images, scored once training ends "
                                                         "(fashion-mnist, digits and a folder of Fashion-MNIST's IDX "
                                                         "files have their own test split)")
    data.add_argument("--valid-fraction", type=FRACTION,
                      help="share of the training images held out, at random, to validate")
    data.add_argument("--image-size", type=COUNT, help="a folder's images are resized to this square side")
    data.add_argument("--channels", type=integer(1), choices=[1, 3], help="a folder's images as grey (1) or RGB (3)")
    data.add_argument("--pad", type=integer(0),
                      help="augmentation: shift by up to this many pixels (default: 0 for vit and swin, whose speedrun "
                           "recipes end before shifts pay off; clip and --recipe classic: a 14th of the side, at "
                           "least 1)")
    data.add_argument("--flip", action=argparse.BooleanOptionalAction,
                      help="augmentation: mirror half the images (default: on for fashion-mnist, off for digits and "
                           "folders, where a mirror image may change the label)")


def _add_classifier_training_arguments(p: argparse.ArgumentParser) -> None:
    train = add_training_arguments(p, batch=("--batch-size", "images per batch"))
    train.add_argument("--label-smoothing", type=PROBABILITY,
                       help="the share of each image's target spread over all classes (validation scores the "
                            "plain loss)")


def add_vit_arguments(p: argparse.ArgumentParser, settings) -> None:
    _add_data_arguments(p)
    model = p.add_argument_group("model (a preset, then any field overridden)")
    model.add_argument("--preset", choices=["fashion-small", "fashion", "vit-base"],
                       help="fashion-small: 4x64, patches of 4 px, 0.2M parameters; fashion: 6x128, 0.8M; vit-base: "
                            "12x768")
    model.add_argument("--patch-size", type=COUNT, help="side of a patch in pixels (the preset's)")
    add_size_arguments(model)
    model.add_argument("--pooling", choices=["cls", "mean"], help="the image vector: [CLS] (default) or mean")
    model.add_argument("--stem", choices=["patch", "conv"],
                       help="pixels to patch vectors: one linear map per patch, or 3x3 convolutions of stride 2 "
                            "(the preset's: patch)")
    model.add_argument("--patch-dropout", type=PROBABILITY,
                       help="the fraction of each training image's patches left out, drawn afresh every time "
                            "(PatchDropout): fewer tokens a step, more images a minute; evaluation and wsd's cool-down "
                            "read them all")
    add_ingredient_arguments(model, activations="the preset's: gelu")
    _add_classifier_training_arguments(p)
    show_defaults(p, settings)


def add_swin_arguments(p: argparse.ArgumentParser, settings) -> None:
    _add_data_arguments(p)
    model = p.add_argument_group("model (a preset, then any field overridden)")
    model.add_argument("--preset", choices=["fashion-small", "fashion", "swin-tiny"],
                       help="fashion-small (the speedrun recipe's): 2 stages (2+2 blocks), 32 wide, patches of 2 px, "
                            "7x7 windows, 0.14M parameters; fashion (the classic recipe's): the same, 48 wide, 0.3M; "
                            "swin-tiny: 4 stages, 96 wide")
    model.add_argument("--patch-size", type=COUNT, help="side of a patch in pixels (the preset's)")
    model.add_argument("--d-model", type=COUNT, help="width of the first stage (doubles at every merge)")
    model.add_argument("--depths", type=COUNT, nargs="+", help="blocks per stage, e.g. 2 2 6 2")
    model.add_argument("--stage-heads", type=COUNT, nargs="+", help="attention heads per stage, e.g. 3 6 12 24")
    model.add_argument("--window-size", type=COUNT, help="side of an attention window in patches (the preset's)")
    model.add_argument("--dropout", type=PROBABILITY)
    add_ingredient_arguments(model, activations="the preset's: gelu")
    _add_classifier_training_arguments(p)
    show_defaults(p, settings)


def add_clip_arguments(p: argparse.ArgumentParser, settings) -> None:
    _add_data_arguments(p)
    model = p.add_argument_group("model (the fashion preset, then any field overridden)")
    model.add_argument("--patch-size", type=COUNT, help="image patches' side in pixels (4)")
    model.add_argument("--d-model", type=COUNT, help="width of both encoders (64)")
    model.add_argument("--n-heads", type=COUNT, help="attention heads of both encoders (4)")
    model.add_argument("--n-layers", type=COUNT, help="image encoder layers (4)")
    model.add_argument("--text-layers", type=COUNT, help="text encoder layers (2)")
    model.add_argument("--projection-dim", type=COUNT, help="width of the shared embedding space (64)")
    model.add_argument("--vocab-size", type=COUNT, help="BPE vocabulary learnt from the training captions")
    add_training_arguments(p, batch=("--batch-size", "image-caption pairs per batch"))
    show_defaults(p, settings)


# --- qkv classify-image / zero-shot ----------------------------------------------------------------------------

def _add_image_inputs(p: argparse.ArgumentParser) -> None:
    p.add_argument("images", nargs="*", metavar="IMAGE", help="PNG or JPEG files")
    p.add_argument("--data", help="instead of files: the test images of fashion-mnist, digits, a folder of "
                                  "Fashion-MNIST's IDX files (its t10k-* files) or a folder of class subfolders (all "
                                  "of them: the accuracy; with --index: those images)")
    p.add_argument("--index", type=integer(0), nargs="+", help="with --data: which test images (0-based)")
    p.add_argument("--resize", action="store_true",
                   help="convert and resize images to what the model reads (else another size or channel count is "
                        "an error)")
    att = p.add_argument_group("attention map")
    att.add_argument("--attention", metavar="FILE.png",
                     help="draw the [CLS] token's attention over an image: every layer and head, and the rollout")
    att.add_argument("--image", type=integer(0), default=0, help="which input image to draw (0-based, default 0)")
    add_force_argument(att, "--attention")
    add_device_arguments(p)


def _inputs(args: argparse.Namespace, meta: dict):
    """(uint8 images (N, C, H, W), names, labels or None) from files or --data."""
    import torch

    from ..images import load_dataset, read_image

    channels, height, width = meta["image_shape"]
    if args.images and args.data:
        raise ValueError("give image files or --data, not both")
    if args.data:
        data = load_dataset(args.data, "test", channels=channels, size=(height, width))
        rows = list(range(len(data))) if args.index is None else args.index
        bad = [i for i in rows if i >= len(data)]
        if bad:
            raise ValueError(f"--index {bad[0]} is past the last of the {len(data)} test images")
        if data.pixels.shape[1:] != (channels, height, width):
            raise ValueError(f"{args.data} has images of {tuple(data.pixels.shape[1:])}, the model reads "
                             f"{(channels, height, width)}")
        return data.pixels[rows], [f"{args.data}[{i}]" for i in rows], data.labels[rows], data.classes
    if args.index is not None:
        raise ValueError("--index picks images of --data; give --data too")
    if not args.images:
        raise ValueError("no images: give PNG/JPEG files, or --data fashion-mnist")
    pixels = [read_image(path, channels=channels, size=(height, width), convert=args.resize) for path in args.images]
    return torch.stack(pixels), list(args.images), None, None


def _attention_picture(args: argparse.Namespace, vit, pixels, names: list[str], titles: list[str], mean, std
                       ) -> None:
    """--attention: the [CLS] attention of image --image, per layer and head, and the rollout; ``names`` says
    which image each is (a file, or ``digits[9]``: the dataset's index), ``titles`` also what the model made of
    it."""
    import torch

    from ..images import normalize
    from ..models import ViT
    from ..tasks.image_attention import attention_rollout, cls_attention
    from ..viz import image_attention

    if not args.attention:
        return
    if not isinstance(vit, ViT):
        raise ValueError(f"--attention draws a [CLS] token's attention; this model is a {type(vit).__name__}, "
                         "which has none (it attends within windows); use a ViT or CLIP model")
    if args.image >= len(pixels):
        raise ValueError(f"--image {args.image} is past the last of the {len(pixels)} images (0-based)")
    image = pixels[args.image : args.image + 1]
    with torch.no_grad():
        attention = vit(normalize(image, mean, std), return_attention=True).attention
    grid = (image.size(2) // vit.config.patch_size, image.size(3) // vit.config.patch_size)
    path = image_attention(image[0], cls_attention(attention, grid=grid), attention_rollout(attention, grid=grid),
                           args.attention, title=titles[args.image])
    print(f"attention of {names[args.image]}: {path}", file=sys.stderr)


def classify_image_cmd(args: argparse.Namespace) -> None:
    from ..checkpoint import load_checkpoint
    from ..tasks.image_classify import predict_images

    check_new_file(args.attention, "--attention", args.force)
    device, _, amp = runtime(args)
    ckpt = load_checkpoint(args.model)
    if ckpt.arch not in ("vit-classifier", "swin-classifier"):
        raise ValueError(f"{ckpt.path} is a {ckpt.arch} checkpoint, not an image classifier (see qkv train vit)")
    pixels, names, truth, _ = _inputs(args, ckpt.meta)
    labels, mean, std = ckpt.meta["labels"], ckpt.meta["mean"], ckpt.meta["std"]  # checked against the model
    with amp:
        model = place(ckpt.model, device, args)
        probs = predict_images(model, pixels, mean=mean, std=std)
    best = probs.argmax(-1)
    if truth is not None and args.index is None:
        print(f"accuracy: {(best == truth).float().mean().item():.2%} on {len(truth):,} {args.data} test images")
    else:
        for name, row, k in zip(names, probs, best.tolist(), strict=True):
            print(f"{labels[k]}\t{row[k]:.3f}\t{name}")
    backbone = ckpt.model.vit if ckpt.arch == "vit-classifier" else ckpt.model.swin
    titles = [f"{name}: {labels[k]} {row[k]:.2f}" for name, row, k in zip(names, probs, best.tolist(), strict=True)]
    with amp:
        _attention_picture(args, backbone, pixels.to(device), names, titles, mean, std)


def _label_classes(labels: list[str], classes: list[str], meta: dict, data: str) -> list[int]:
    """With --data and --labels, the dataset class each label stands for, so that an accuracy compares like with
    like: labels that name classes (the dataset's names, or the caption names of the model's own data, in any
    case) stand for those, and only those classes' images are scored; labels that name none of them rename the
    classes in order, when there is one per class. Anything else is refused."""
    names = {name.lower(): i for i, name in enumerate(classes)}
    if classes == meta.get("labels"):
        names.update({name.lower(): i for i, name in enumerate(meta.get("class_names", ()))})
    found = [names.get(label.lower()) for label in labels]
    if None not in found and len(set(found)) == len(found):
        return found
    if set(found) == {None} and len(labels) == len(classes):
        log.info("--labels name none of %s's classes: read as their new names, in order (%s)", data,
                 ", ".join(f"{c}={label}" for c, label in zip(classes, labels, strict=True)))
        return list(range(len(classes)))
    unknown = [label for label, i in zip(labels, found, strict=True) if i is None]
    problem = f"{unknown[0]!r} is none of them" if unknown else "a class is named twice"
    raise ValueError(f"--labels: an accuracy on {data} needs labels that each name one of its {len(classes)} classes "
                     f"({', '.join(classes)}) or one new name per class, in that order; {problem}. Drop --labels to "
                     "use the dataset's classes, or add --index to label chosen images")


def zero_shot_cmd(args: argparse.Namespace) -> None:
    import torch

    from ..checkpoint import load_checkpoint
    from ..models.clip import MAX_LOGIT_SCALE
    from ..tasks.captions import check_template
    from ..tasks.contrastive import embed_images, text_classifier

    labels = [label.strip() for label in (args.labels or "").split(",")]
    if args.labels is not None and not all(labels):
        raise ValueError(f"--labels {args.labels!r} has an empty label; give names separated by commas, e.g. "
                         "--labels 'sneaker,sandal,bag'")
    for template in args.template or ():
        check_template(template, "--template")
    check_new_file(args.attention, "--attention", args.force)
    device, _, amp = runtime(args)
    ckpt = load_checkpoint(args.model)
    meta = ckpt.meta
    if ckpt.arch != "clip":
        raise ValueError(f"{ckpt.path} is a {ckpt.arch} checkpoint, not a CLIP (see qkv train clip)")
    templates = args.template or [check_template(t, f"{ckpt.path}: the config's template") for t in meta["templates"]]
    pixels, names, truth, classes = _inputs(args, meta)
    scoring = truth is not None and args.index is None
    if args.labels is None:
        if truth is None:
            raise ValueError("no labels: give the class names with --labels 'a,b,c'")
        labels = meta["class_names"] if classes == meta["labels"] else classes
        label_classes = list(range(len(labels)))
    elif scoring:
        label_classes = _label_classes(labels, classes, meta, args.data)
    with amp:
        model = place(ckpt.model, device, args).eval()
        classifier = text_classifier(model, ckpt.tokenizers["text"], labels, templates)
        sims = embed_images(model, pixels, mean=meta["mean"], std=meta["std"]) @ classifier.t()
    probs = (sims * model.logit_scale.exp().clamp(max=MAX_LOGIT_SCALE).item()).softmax(-1)
    best = probs.argmax(-1)
    if scoring:
        target = torch.tensor(label_classes)  # label i -> the dataset class it stands for
        scored = torch.isin(truth, target)  # only the images of classes some label stands for
        accuracy = (target[best] == truth)[scored].float().mean().item()
        of = f" of the {len(labels)} classes --labels names" if len(labels) < len(classes) else ""
        print(f"zero-shot accuracy: {accuracy:.2%} on {int(scored.sum()):,} {args.data} test images{of}, labels "
              f"{labels}, {len(templates)} templates")
    else:
        for name, row, k in zip(names, probs, best.tolist(), strict=True):
            print(f"{labels[k]}\t{row[k]:.3f}\t{name}")
    titles = [f"{name}: zero-shot '{labels[k]}' {row[k]:.2f}" for name, row, k in zip(names, probs, best.tolist(),
                                                                                        strict=True)]
    with amp:
        _attention_picture(args, model.vision, pixels.to(device), names, titles, meta["mean"], meta["std"])


# --- registration ----------------------------------------------------------------------------------------------

def add_commands(sub) -> None:
    cls = command(sub, "classify-image", "label images with a ViT or Swin from qkv train vit|swin")
    cls.add_argument("--model", required=True, help="an image classifier checkpoint or run directory (uses best/)")
    _add_image_inputs(cls)
    cls.set_defaults(run=classify_image_cmd)

    zs = command(sub, "zero-shot", "label images by class names alone, with a CLIP from qkv train clip")
    zs.add_argument("--model", required=True, help="a CLIP checkpoint or run directory (uses best/)")
    zs.add_argument("--labels", help="class names separated by commas, e.g. 'sneaker,sandal,bag' (with --data: "
                                     "default the dataset's)")
    zs.add_argument("--template", action="append", metavar="TEXT",
                    help="a prompt with {} for the label; repeat for more (default: the model's held-out templates)")
    _add_image_inputs(zs)
    zs.set_defaults(run=zero_shot_cmd)
